import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestInstance, TestWorld, eventually, sleep } from '../support/harness.js';

describe('review tasks', () => {
  const world = new TestWorld('tasks');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start();
    b = await world.start();
  });
  afterAll(() => world.cleanup());

  async function taskPool(name: string, tasks: { value: string; groupKey?: string }[], pool: Record<string, unknown> = {}) {
    expect((await a.post('/v1/pools', { name, kind: 'task', ...pool })).status).toBe(201);
    expect((await a.post(`/v1/pools/${name}/resources`, { items: tasks })).status).toBe(201);
  }
  const next = (api: TestInstance, pool: string, reviewer: string, leaseMs?: number) =>
    api.post(`/v1/pools/${pool}/tasks/next`, leaseMs ? { reviewer, leaseMs } : { reviewer });

  it('45 concurrent pulls on 30 tasks give 30 distinct tasks and 15 × 204', async () => {
    await taskPool(
      'review',
      Array.from({ length: 30 }, (_, i) => ({ value: `task-${i}` })),
    );
    const answers = await Promise.all(Array.from({ length: 45 }, (_, i) => next(i % 2 ? a : b, 'review', `r-${i}`)));
    const leased = answers.filter((r) => r.status === 200);
    expect(leased).toHaveLength(30);
    expect(answers.filter((r) => r.status === 204)).toHaveLength(15);
    for (const r of answers.filter((x) => x.status === 204)) expect(r.body).toBeUndefined();
    expect(new Set(leased.map((r) => r.body.resourceId)).size).toBe(30);
    expect(leased[0].body).toMatchObject({ groupKey: null, attributes: {} });
    expect(leased[0].body.value).toMatch(/^task-\d+$/);
  });

  it('abandon gives the task out again at once; complete allocates it and is idempotent', async () => {
    await taskPool('single', [{ value: 'task-1' }]);
    const lease = await next(a, 'single', 'r-1');
    expect(lease.status).toBe(200);
    expect((await next(b, 'single', 'r-2')).status).toBe(204);
    const abandoned = await b.post(`/v1/tasks/${lease.body.leaseId}/abandon`);
    expect(abandoned.status).toBe(200);
    expect(abandoned.body).toEqual({ leaseId: lease.body.leaseId, resourceId: lease.body.resourceId, state: 'abandoned' });
    const again = await next(b, 'single', 'r-2');
    expect(again.status).toBe(200);
    expect(again.body.resourceId).toBe(lease.body.resourceId);

    const done = await a.post(`/v1/tasks/${again.body.leaseId}/complete`);
    const doneAgain = await b.post(`/v1/tasks/${again.body.leaseId}/complete`);
    expect(done.status).toBe(200);
    expect(done.body).toEqual({ leaseId: again.body.leaseId, resourceId: again.body.resourceId, state: 'completed' });
    expect(doneAgain.body).toEqual(done.body);
    const [row] = await world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [again.body.resourceId]);
    expect(row).toEqual({ state: 2, version: 1, owner: 'r-2' });
    expect((await next(a, 'single', 'r-3')).status).toBe(204);
    const abandonDone = await a.post(`/v1/tasks/${again.body.leaseId}/abandon`);
    expect(abandonDone.status).toBe(409);
    expect(abandonDone.body.error.code).toBe('RESERVATION_CLOSED');
  });

  it('an expired lease returns its task to the pool; heartbeat keeps a lease alive and is HOLD_EXPIRED once it ran out', async () => {
    await taskPool('expiring', [{ value: 'task-a' }, { value: 'task-b' }], { holdTtlMs: 1000, maxHoldTtlMs: 60_000 });
    const vanished = await next(a, 'expiring', 'vanisher');
    const kept = await next(a, 'expiring', 'keeper', 1000);
    const beat = await a.post(`/v1/tasks/${kept.body.leaseId}/heartbeat`, { leaseMs: 30_000 });
    expect(beat.status).toBe(200);
    expect(Date.parse(beat.body.expiresAt) - Date.now()).toBeGreaterThan(25_000);
    const { value } = await eventually(async () => {
      const r = await next(b, 'expiring', 'patient');
      return r.status === 200 ? r : null;
    }, 4000);
    expect(value.body.resourceId).toBe(vanished.body.resourceId);
    const late = await a.post(`/v1/tasks/${vanished.body.leaseId}/heartbeat`, { leaseMs: 5000 });
    expect(late.status).toBe(409);
    expect(late.body.error.code).toBe('HOLD_EXPIRED');
    expect((await a.post(`/v1/tasks/${kept.body.leaseId}/complete`)).status).toBe(200);
  });

  it('prefers a task from a group the reviewer already leases in', async () => {
    const tasks = [];
    for (const g of ['g1', 'g2', 'g3', 'g4']) for (let i = 0; i < 5; i++) tasks.push({ value: `${g}-task-${i}`, groupKey: g });
    await taskPool('grouped', tasks);
    const first = await next(a, 'grouped', 'r-aff');
    const group = first.body.groupKey;
    expect(group).toMatch(/^g[1-4]$/);
    for (let i = 0; i < 4; i++) {
      const more = await next(i % 2 ? a : b, 'grouped', 'r-aff');
      expect(more.body.groupKey).toBe(group);
    }
    // The group is used up: the reviewer moves to another one.
    const other = await next(a, 'grouped', 'r-aff');
    expect(other.status).toBe(200);
    expect(other.body.groupKey).not.toBe(group);
  });

  it('refuses bad task calls', async () => {
    await a.post('/v1/pools', { name: 'numbers-only', kind: 'number' });
    const wrongKind = await next(a, 'numbers-only', 'r-1');
    expect(wrongKind.status).toBe(400);
    expect(wrongKind.body.error.code).toBe('VALIDATION_FAILED');
    expect((await a.post('/v1/pools/review/tasks/next', {})).status).toBe(400);
    expect((await a.post('/v1/pools/review/tasks/next', { reviewer: 'r', leaseMs: 10 })).status).toBe(400);
    // NUL, which Postgres' text cannot hold: the lease would be taken and its completion fail.
    const nul = await next(a, 'review', 'r\0');
    expect(nul.status).toBe(400);
    expect(nul.body.error.details.fields.map((f: { field: string }) => f.field)).toEqual(['reviewer']);
    expect((await a.post('/v1/pools/missing/tasks/next', { reviewer: 'r' })).body.error.code).toBe('POOL_NOT_FOUND');
    const unknown = 'review.3f1c2a9e-5b7d-4e8f-9a0b-1c2d3e4f5a6b';
    for (const path of ['heartbeat', 'complete', 'abandon']) {
      const answer = await a.post(`/v1/tasks/${unknown}/${path}`, {});
      expect(answer.status).toBe(404);
      expect(answer.body.error.code).toBe('RESERVATION_NOT_FOUND');
      expect((await a.post(`/v1/tasks/not-a-lease/${path}`, {})).status).toBe(400);
    }
    // A reservation of a number pool is no lease: the task calls do not touch it.
    await a.post('/v1/pools/numbers-only/resources', { items: [{ value: '1' }, { value: '2' }] });
    const r = await a.post('/v1/pools/numbers-only/reservations', { owner: 'buyer', count: 2 });
    for (const path of ['heartbeat', 'complete', 'abandon']) {
      const answer = await a.post(`/v1/tasks/${r.body.id}/${path}`, {});
      expect(answer.status, path).toBe(404);
      expect(answer.body.error.code).toBe('RESERVATION_NOT_FOUND');
    }
    expect((await a.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
    expect((await a.get('/v1/pools/numbers-only')).body.stats).toEqual({ total: 2, free: 0, held: 2, allocated: 0 });
  });

  it('a reservation made through /reservations on a task pool is no lease: the task calls answer 404 and change nothing', async () => {
    await taskPool('mixed', [{ value: 'task-1' }, { value: 'task-2' }, { value: 'task-3' }]);
    const r = await a.post('/v1/pools/mixed/reservations', { owner: 'rv', count: 2 });
    expect(r.status).toBe(201);
    for (const path of ['heartbeat', 'complete', 'abandon']) {
      const answer = await a.post(`/v1/tasks/${r.body.id}/${path}`, {});
      expect(answer.status, path).toBe(404);
      expect(answer.body.error.code).toBe('RESERVATION_NOT_FOUND');
    }
    const after = await a.get(`/v1/reservations/${r.body.id}`);
    expect(after.body).toMatchObject({ state: 'held', expiresAt: r.body.expiresAt });
    expect((await a.get('/v1/pools/mixed')).body.stats).toEqual({ total: 3, free: 1, held: 2, allocated: 0 });
    // A lease of the same pool is served as before.
    const lease = await next(a, 'mixed', 'r-1');
    expect((await a.post(`/v1/tasks/${lease.body.leaseId}/complete`, {})).body).toMatchObject({ state: 'completed' });
  });

  it('complete and abandon take no body: a field is refused like any unknown one, and changes nothing', async () => {
    await taskPool('no-body', [{ value: 'task-1' }]);
    const lease = await next(a, 'no-body', 'r-1');
    expect(lease.status).toBe(200);
    for (const path of ['complete', 'abandon']) {
      for (const body of [{ leaseMs: 1000 }, [1], '"x"', 'null']) {
        const answer = await a.post(`/v1/tasks/${lease.body.leaseId}/${path}`, body);
        expect(answer.status, `${path} ${JSON.stringify(body)}`).toBe(400);
        expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      }
    }
    expect((await a.get('/v1/pools/no-body')).body.stats).toEqual({ total: 1, free: 0, held: 1, allocated: 0 });
    // No body, or an empty object, as before.
    expect((await a.request('POST', `/v1/tasks/${lease.body.leaseId}/complete`)).status).toBe(200);
    expect((await a.post(`/v1/tasks/${lease.body.leaseId}/complete`, {})).status).toBe(200);
  });

  it("a heartbeat's body is optional, but a JSON null is refused and does not extend the lease", async () => {
    await taskPool('null-beat', [{ value: 'task-1' }]);
    const lease = await next(a, 'null-beat', 'r-1', 1000);
    expect(lease.status).toBe(200);
    const nullBeat = await a.request('POST', `/v1/tasks/${lease.body.leaseId}/heartbeat`, null);
    expect(nullBeat.status).toBe(400);
    expect(nullBeat.body.error.details.fields).toEqual([{ field: 'body', reason: 'the body must be a JSON object' }]);
    // Had it extended the lease by the pool's holdTtlMs, this heartbeat past the first expiresAt would succeed.
    await sleep(Date.parse(lease.body.expiresAt) - Date.now() + 200);
    const late = await a.request('POST', `/v1/tasks/${lease.body.leaseId}/heartbeat`);
    expect(late.status).toBe(409);
    expect(late.body.error.code).toBe('HOLD_EXPIRED');
  });
});
