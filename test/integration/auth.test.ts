import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestInstance, TestWorld, numbers } from '../support/harness.js';

const ADMIN = 'admin-key-0123456789abcdef';
const CLIENT = 'client-key-0123456789abcdef';
const REVIEWER = 'reviewer-key-0123456789abcdef';

/** API_KEYS set: API.md's 401 UNAUTHENTICATED and 403 FORBIDDEN, by the roles of its sections. */
describe('API keys', () => {
  const world = new TestWorld('auth');
  let api: TestInstance;
  const as = (key: string) => ({ authorization: `Bearer ${key}` });

  beforeAll(async () => {
    api = await world.start({ API_KEYS: `admin:${ADMIN},client:${CLIENT},reviewer:${REVIEWER}` });
  });
  afterAll(() => world.cleanup());

  it('without a key, or with a wrong one, a call is 401 UNAUTHENTICATED and changes nothing, whatever its body', async () => {
    const attempts: Record<string, string>[] = [
      {},
      as('not-a-key-of-this-deployment'),
      { 'x-api-key': `${ADMIN}x` },
      { authorization: ADMIN },
    ];
    for (const headers of attempts) {
      const answer = await api.post('/v1/pools', { name: 'nokey', kind: 'number' }, headers);
      expect(answer.status, JSON.stringify(headers)).toBe(401);
      expect(answer.body.error).toMatchObject({ code: 'UNAUTHENTICATED', details: { roles: ['admin'] } });
      // Checked before the body: a bad one is not reported to a caller without a key.
      expect((await api.post('/v1/pools', { bogus: 1 }, headers)).body.error.code).toBe('UNAUTHENTICATED');
    }
    expect((await api.request('GET', '/v1/pools/nokey', undefined, as(ADMIN))).status).toBe(404);
    // Before the body is read: not JSON, not a JSON type, a query string, all 401.
    const early = [
      await api.request('POST', '/v1/pools', '{"name":', { 'content-type': 'application/json' }),
      await api.request('POST', '/v1/pools', 'name=x', { 'content-type': 'application/x-www-form-urlencoded' }),
      await api.request('POST', '/v1/pools?x=1', { name: 'nokey', kind: 'number' }),
    ];
    expect(early.map((answer) => [answer.status, answer.body.error.code])).toEqual(Array(3).fill([401, 'UNAUTHENTICATED']));
  });

  it('a key of another role is 403 FORBIDDEN and changes nothing; the role API.md names goes through', async () => {
    const created = await api.post('/v1/pools', { name: 'phones', kind: 'number' }, as(CLIENT));
    expect(created.status).toBe(403);
    expect(created.body.error).toMatchObject({ code: 'FORBIDDEN', details: { role: 'client', roles: ['admin'] } });
    expect((await api.request('GET', '/v1/pools/phones', undefined, as(ADMIN))).status).toBe(404);

    expect((await api.post('/v1/pools', { name: 'phones', kind: 'number' }, as(ADMIN))).status).toBe(201);
    expect(
      (await api.post('/v1/pools/phones/resources', { items: numbers(3).map((value) => ({ value })) }, { 'x-api-key': ADMIN })).status,
    ).toBe(201);
    const byReviewer = await api.post('/v1/pools/phones/reservations', { owner: 'u', count: 3 }, as(REVIEWER));
    expect(byReviewer.status).toBe(403);
    expect((await api.request('GET', '/v1/pools/phones', undefined, as(ADMIN))).body.stats).toMatchObject({ free: 3, held: 0 });

    const r = await api.post('/v1/pools/phones/reservations', { owner: 'u', count: 3 }, { 'x-api-key': CLIENT });
    expect(r.status).toBe(201);
    expect((await api.request('GET', `/v1/reservations/${r.body.id}`, undefined, as(ADMIN))).status).toBe(403);
    const chosen = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] }, as(REVIEWER))).status).toBe(403);
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] }, as(CLIENT))).status).toBe(200);
    // Release: client or admin.
    const release = `/v1/pools/phones/resources/${chosen}/release`;
    expect((await api.post(release, { owner: 'u' }, as(REVIEWER))).status).toBe(403);
    expect((await api.post(release, { owner: 'u' }, as(CLIENT))).status).toBe(200);
    expect((await api.post(release, { owner: 'u' }, as(ADMIN))).body.error.code).toBe('NOT_ALLOCATED');
  });

  it('review tasks need the reviewer role', async () => {
    expect((await api.post('/v1/pools', { name: 'reviews', kind: 'task' }, as(ADMIN))).status).toBe(201);
    expect((await api.post('/v1/pools/reviews/resources', { items: [{ value: 'task-1' }] }, as(ADMIN))).status).toBe(201);
    expect((await api.post('/v1/pools/reviews/tasks/next', { reviewer: 'r-7' }, as(CLIENT))).status).toBe(403);
    const lease = await api.post('/v1/pools/reviews/tasks/next', { reviewer: 'r-7' }, as(REVIEWER));
    expect(lease.status).toBe(200);
    expect((await api.post(`/v1/tasks/${lease.body.leaseId}/complete`, undefined, as(ADMIN))).status).toBe(403);
    expect((await api.post(`/v1/tasks/${lease.body.leaseId}/complete`, undefined, as(REVIEWER))).status).toBe(200);
  });

  it('the operations endpoints need no key; the OpenAPI document lists both key schemes on every /v1 call', async () => {
    for (const path of ['/health/live', '/health/ready', '/metrics', '/docs-json']) expect((await api.get(path)).status, path).toBe(200);
    const doc = (await api.get('/docs-json')).body;
    expect(Object.keys(doc.components.securitySchemes).sort()).toEqual(['apiKey', 'bearer']);
    let calls = 0;
    for (const [path, methods] of Object.entries<Record<string, { security?: unknown[]; responses: Record<string, unknown> }>>(doc.paths)) {
      for (const operation of Object.values(methods)) {
        if (!path.startsWith('/v1/')) {
          expect(operation.security, path).toBeUndefined();
          continue;
        }
        calls++;
        expect(operation.security, path).toEqual(expect.arrayContaining([{ bearer: [] }, { apiKey: [] }]));
        expect(Object.keys(operation.responses), path).toEqual(expect.arrayContaining(['401', '403']));
      }
    }
    expect(calls).toBe(15);
  });
});
