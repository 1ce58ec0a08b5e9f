import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestInstance, TestWorld, numbers } from '../support/harness.js';

const ADMIN = 'admin-key-0123456789abcdef';
const CLIENT = 'client-key-0123456789abcdef';
const REVIEWER = 'reviewer-key-0123456789abcdef';
/** Keys bound to one owner, and to one reviewer. */
const USER_1 = 'user-1-key-0123456789abcdef';
const R_1 = 'r-1-key-0123456789abcdef';
/** A client key bound to an owner named as a reviewer is: owners and reviewers share one space of names. */
const CLIENT_R_1 = 'client-r-1-key-0123456789abcdef';

/** API_KEYS set: API.md's 401 UNAUTHENTICATED and 403 FORBIDDEN, by the roles of its sections. */
describe('API keys', () => {
  const world = new TestWorld('auth');
  let api: TestInstance;
  const as = (key: string) => ({ authorization: `Bearer ${key}` });

  beforeAll(async () => {
    api = await world.start({
      API_KEYS: `admin:${ADMIN},client:${CLIENT},reviewer:${REVIEWER},client:${USER_1}:user-1,reviewer:${R_1}:r-1,client:${CLIENT_R_1}:r-1`,
    });
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
      expect(answer.headers.get('www-authenticate')).toBe('Bearer realm="respool"');
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

  it('a key bound to an owner acts for that owner only: 403 FORBIDDEN for another one, and nothing changes', async () => {
    expect((await api.post('/v1/pools', { name: 'bound', kind: 'number' }, as(ADMIN))).status).toBe(201);
    expect((await api.post('/v1/pools/bound/resources', { items: numbers(6).map((value) => ({ value })) }, as(ADMIN))).status).toBe(201);
    const forOther = await api.post('/v1/pools/bound/reservations', { owner: 'user-2', count: 1 }, as(USER_1));
    expect(forOther.status).toBe(403);
    expect(forOther.body.error).toMatchObject({ code: 'FORBIDDEN', details: { actingFor: 'user-1' } });
    const other = await api.post('/v1/pools/bound/reservations', { owner: 'user-2', count: 2 }, as(CLIENT));
    expect(other.status).toBe(201);
    const path = `/v1/reservations/${other.body.id}`;
    const refused = [
      await api.request('GET', path, undefined, as(USER_1)),
      await api.post(`${path}/extend`, { ttlMs: 60_000 }, as(USER_1)),
      await api.post(`${path}/confirm`, { resourceIds: [other.body.items[0].resourceId] }, as(USER_1)),
      await api.request('DELETE', path, undefined, as(USER_1)),
    ];
    expect(refused.map((answer) => [answer.status, answer.body.error.code])).toEqual(Array(4).fill([403, 'FORBIDDEN']));
    const unchanged = await api.request('GET', path, undefined, as(CLIENT));
    expect([unchanged.body.state, unchanged.body.expiresAt]).toEqual(['held', other.body.expiresAt]);
    expect((await api.request('GET', '/v1/pools/bound', undefined, as(ADMIN))).body.stats).toMatchObject({ held: 2, allocated: 0 });

    const mine = await api.post('/v1/pools/bound/reservations', { owner: 'user-1', count: 2 }, as(USER_1));
    expect(mine.status).toBe(201);
    const chosen = mine.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${mine.body.id}/confirm`, { resourceIds: [chosen] }, as(USER_1))).status).toBe(200);
    expect((await api.request('GET', `/v1/reservations/${mine.body.id}`, undefined, as(USER_1))).body.state).toBe('confirmed');
    const release = `/v1/pools/bound/resources/${chosen}/release`;
    expect((await api.post(release, { owner: 'user-2' }, as(USER_1))).status).toBe(403);
    expect((await api.post(release, { owner: 'user-1' }, as(USER_1))).status).toBe(200);
  });

  it('a key bound to a reviewer pulls, heartbeats, completes and abandons for that reviewer only', async () => {
    expect((await api.post('/v1/pools', { name: 'bound-reviews', kind: 'task' }, as(ADMIN))).status).toBe(201);
    const items = [{ value: 'task-a' }, { value: 'task-b' }, { value: 'task-c' }];
    expect((await api.post('/v1/pools/bound-reviews/resources', { items }, as(ADMIN))).status).toBe(201);
    expect((await api.post('/v1/pools/bound-reviews/tasks/next', { reviewer: 'r-2' }, as(R_1))).status).toBe(403);
    const theirs = await api.post('/v1/pools/bound-reviews/tasks/next', { reviewer: 'r-2' }, as(REVIEWER));
    expect(theirs.status).toBe(200);
    for (const step of ['heartbeat', 'complete', 'abandon']) {
      const answer = await api.post(`/v1/tasks/${theirs.body.leaseId}/${step}`, undefined, as(R_1));
      expect([step, answer.status]).toEqual([step, 403]);
    }
    expect((await api.request('GET', '/v1/pools/bound-reviews', undefined, as(ADMIN))).body.stats).toMatchObject({ held: 1, allocated: 0 });
    const own = await api.post('/v1/pools/bound-reviews/tasks/next', { reviewer: 'r-1' }, as(R_1));
    expect(own.status).toBe(200);
    // A client key bound to "r-1" does not reach r-1's lease through the reservation calls.
    const asClient = await api.request('DELETE', `/v1/reservations/${own.body.leaseId}`, undefined, as(CLIENT_R_1));
    expect([asClient.status, asClient.body.error.code]).toEqual([404, 'RESERVATION_NOT_FOUND']);
    expect((await api.post(`/v1/tasks/${own.body.leaseId}/complete`, undefined, as(R_1))).status).toBe(200);
    // Nor can it release the item r-1's completion allocated (a buyer named like a reviewer is not that reviewer).
    const release = `/v1/pools/bound-reviews/resources/${own.body.resourceId}/release`;
    const refused = await api.post(release, { owner: 'r-1' }, as(CLIENT_R_1));
    expect([refused.status, refused.body.error.code]).toEqual([409, 'NOT_ALLOCATED']);
    expect(refused.body.error.message).toContain('by a completed task');
    expect((await api.request('GET', `/v1/pools/bound-reviews/resources/${own.body.resourceId}`, undefined, as(ADMIN))).body).toMatchObject({
      state: 'allocated',
      owner: 'r-1',
      version: 1,
    });
    // A reservation that key made on the task pool is its own to release once confirmed; an admin releases either.
    const reserved = await api.post('/v1/pools/bound-reviews/reservations', { owner: 'r-1', count: 1 }, as(CLIENT_R_1));
    const item = reserved.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${reserved.body.id}/confirm`, { resourceIds: [item] }, as(CLIENT_R_1))).status).toBe(200);
    expect((await api.post(`/v1/pools/bound-reviews/resources/${item}/release`, { owner: 'r-1' }, as(CLIENT_R_1))).status).toBe(200);
    expect((await api.post(release, { owner: 'r-1' }, as(ADMIN))).status).toBe(200);
  });

  it('the operations endpoints need no key; the OpenAPI document lists both key schemes on every /v1 call', async () => {
    for (const path of ['/health/live', '/health/ready', '/metrics', '/docs-json']) expect((await api.get(path)).status, path).toBe(200);
    const doc = (await api.get('/docs-json')).body;
    expect(Object.keys(doc.components.securitySchemes).sort()).toEqual(['apiKey', 'bearer']);
    // An API key, not a JWT.
    expect(doc.components.securitySchemes.bearer).toMatchObject({ type: 'http', scheme: 'bearer', bearerFormat: 'API key' });
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
        expect((operation.responses['401'] as { headers?: object }).headers, path).toHaveProperty(['WWW-Authenticate']);
      }
    }
    expect(calls).toBe(15);
  });
});
