import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestInstance, TestWorld, numbers, seedPool } from '../support/harness.js';

describe('operations: health, metrics, OpenAPI, request ids', () => {
  const world = new TestWorld('operations');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  it('reports liveness and readiness of Postgres and Redis', async () => {
    expect((await api.get('/health/live')).status).toBe(200);
    const ready = await api.get('/health/ready');
    expect(ready.status).toBe(200);
    expect(ready.body.info).toMatchObject({ postgres: { status: 'up' }, redis: { status: 'up' } });
  });

  it('exports Prometheus metrics: latency by route, reservations by outcome, pool gauges, conflicts, expiries', async () => {
    await seedPool(api, 'metered', numbers(3));
    const r = await api.post('/v1/pools/metered/reservations', { owner: 'm', count: 2 });
    await api.post('/v1/pools/metered/reservations', { owner: 'm', count: 5 });
    await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    const metrics = await api.get('/metrics');
    expect(metrics.status).toBe(200);
    expect(metrics.headers.get('content-type')).toMatch(/text\/plain/);
    const text = metrics.body as string;
    expect(text).toMatch(
      /respool_http_request_duration_seconds_count\{method="POST",route="\/v1\/pools\/:pool\/reservations",status="201"\} 1/,
    );
    expect(text).toContain('respool_reservations_total{pool="metered",outcome="ok"} 1');
    expect(text).toContain('respool_reservations_total{pool="metered",outcome="exhausted"} 1');
    expect(text).toContain('respool_pool_items{pool="metered",state="free"} 2');
    expect(text).toContain('respool_pool_items{pool="metered",state="allocated"} 1');
    expect(text).toContain('respool_pool_items{pool="metered",state="held"} 0');
    expect(text).toContain('# TYPE respool_confirm_conflicts_total counter');
    expect(text).toContain('# TYPE respool_expired_holds_total counter');
  });

  it('serves the OpenAPI document, generated from the code, with every field described', async () => {
    const doc = (await api.get('/docs-json')).body;
    expect(doc.openapi).toMatch(/^3\./);
    for (const path of [
      '/v1/pools',
      '/v1/pools/{pool}',
      '/v1/pools/{pool}/resources',
      '/v1/pools/{pool}/resources/{id}',
      '/v1/pools/{pool}/resources/{id}/release',
      '/v1/pools/{pool}/reservations',
      '/v1/reservations/{id}',
      '/v1/reservations/{id}/extend',
      '/v1/reservations/{id}/confirm',
      '/v1/pools/{pool}/tasks/next',
      '/v1/tasks/{leaseId}/heartbeat',
      '/v1/tasks/{leaseId}/complete',
      '/v1/tasks/{leaseId}/abandon',
      '/health/live',
      '/health/ready',
    ]) {
      expect(doc.paths, path).toHaveProperty([path]);
    }
    const undescribed: string[] = [];
    for (const [name, schema] of Object.entries<any>(doc.components.schemas)) {
      for (const [field, prop] of Object.entries<any>(schema.properties ?? {})) {
        const described = prop.description || prop.allOf?.some((p: any) => p.description);
        if (!described) undescribed.push(`${name}.${field}`);
      }
    }
    expect(undescribed).toEqual([]);
    expect(doc.components.schemas.CreateReservationDto.required).toEqual(['owner']);
    expect(doc.paths['/v1/pools/{pool}/reservations'].post.responses).toHaveProperty('409');
    expect((await api.get('/docs')).status).toBe(200);
  });

  it('echoes a request id, or makes one', async () => {
    const given = await api.request('GET', '/health/live', undefined, { 'x-request-id': 'abc-123' });
    expect(given.headers.get('x-request-id')).toBe('abc-123');
    const made = await api.get('/health/live');
    expect(made.headers.get('x-request-id')).toMatch(/^[0-9a-f-]{36}$/);
  });

  it('answers unknown routes with the API error body', async () => {
    const answer = await api.get('/v2/nothing');
    expect(answer.status).toBe(404);
    expect(answer.body).toEqual({ error: { code: 'ROUTE_NOT_FOUND', message: 'no such route', details: {} } });
  });
});
