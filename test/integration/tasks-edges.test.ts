/**
 * Review-task leases at their edges, on two instances.
 *
 * 1. Under contention: reviewers pull, heartbeat near expiry, complete before and after expiry, abandon and release,
 *    all at once. Judged from the clients' side (what each one was answered, and when) and from Postgres: no task
 *    handed to two reviewers while a lease on it is surely live, a heartbeat or complete sent before expiresAt
 *    succeeds, each 200 complete allocated exactly once, and once everything has ended, nothing still held or
 *    counted against a reviewer.
 * 2. After a closed reservation's record has left Redis (RESERVATION_RETENTION_MS): the task calls still act on
 *    leases only, and they and extend answer a call as they answered it before.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TestInstance, TestWorld, sleep } from '../support/harness.js';
import { mulberry32 } from '../support/random.js';

interface Lease {
  id: string;
  reviewer: string;
  taskId: string;
  group: string | null;
  sentAt: number;
  answeredAt: number;
  expiresAt: number; // the latest expiresAt the service answered (pull or heartbeat)
  endSentAt: number; // when the first successful complete/abandon was sent (Infinity: never)
  completed: boolean;
}

describe('review-task leases under contention', () => {
  const world = new TestWorld('tedges', { REDIS_TIMEOUT_MS: '10000' });
  const apis: TestInstance[] = [];
  beforeAll(async () => {
    apis.push(await world.start());
    apis.push(await world.start());
  });
  afterAll(() => world.cleanup());

  it('no task under two live leases, heartbeats and completes before expiresAt succeed, each completion allocated once', async () => {
    const rnd = mulberry32(Number(process.env.TASK_EDGE_SEED ?? 7));
    const int = (lo: number, hi: number) => lo + Math.floor(rnd() * (hi - lo + 1));
    const pool = 'contended';
    expect((await apis[0].post('/v1/pools', { name: pool, kind: 'task', holdTtlMs: 1000, maxHoldsPerOwner: 2 })).status).toBe(201);
    const items = Array.from({ length: 5 }, (_, i) => ({ value: `t-${i}`, ...(i < 4 && { groupKey: `g${i % 2}` }) }));
    expect((await apis[0].post(`/v1/pools/${pool}/resources`, { items })).status).toBe(201);

    const leases: Lease[] = [];
    const problems: string[] = [];
    const deadline = Date.now() + 5000;
    const reviewer = async (name: string) => {
      while (Date.now() < deadline) {
        const api = apis[int(0, 1)];
        const sentAt = Date.now();
        const r = await api.post(`/v1/pools/${pool}/tasks/next`, { reviewer: name, leaseMs: int(1000, 1400) });
        const answeredAt = Date.now();
        if (r.status !== 200) {
          if (r.status !== 204 && !(r.status === 429 && r.body.error.code === 'OWNER_QUOTA_EXCEEDED'))
            problems.push(`pull: ${r.status} ${JSON.stringify(r.body)}`);
          await sleep(int(20, 120));
          continue;
        }
        const l: Lease = {
          id: r.body.leaseId,
          reviewer: name,
          taskId: r.body.resourceId,
          group: r.body.groupKey,
          sentAt,
          answeredAt,
          expiresAt: Date.parse(r.body.expiresAt),
          endSentAt: Infinity,
          completed: false,
        };
        leases.push(l);
        // Heartbeats, some of them close to expiresAt.
        for (let beats = int(0, 2); beats > 0; beats--) {
          await sleep(Math.max(0, l.expiresAt - Date.now() - int(60, 400)));
          const hb = await apis[int(0, 1)].post(`/v1/tasks/${l.id}/heartbeat`, { leaseMs: int(1000, 1400) });
          const hbAnswered = Date.now();
          // Answered before expiresAt, it surely reached the service in time (a busy machine may delay one sent in time).
          if (hb.status === 200) l.expiresAt = Date.parse(hb.body.expiresAt);
          else if (hbAnswered < l.expiresAt - 20)
            problems.push(`heartbeat answered ${l.expiresAt - hbAnswered} ms before expiresAt: ${hb.status} ${JSON.stringify(hb.body)}`);
        }
        const end = int(0, 9);
        if (end < 5) {
          // Complete, before expiresAt (most) or a little after it.
          const at = end < 4 ? l.expiresAt - int(60, 600) : l.expiresAt + int(0, 800);
          await sleep(Math.max(0, at - Date.now()));
          const cSent = Date.now();
          const c = await apis[int(0, 1)].post(`/v1/tasks/${l.id}/complete`);
          const cAnswered = Date.now();
          if (c.status === 200) {
            l.completed = true;
            l.endSentAt = Math.min(l.endSentAt, cSent);
            if (JSON.stringify(c.body) !== JSON.stringify({ leaseId: l.id, resourceId: l.taskId, state: 'completed' }))
              problems.push(`complete body ${JSON.stringify(c.body)}`);
            const again = await apis[int(0, 1)].post(`/v1/tasks/${l.id}/complete`);
            if (again.status !== 200 || JSON.stringify(again.body) !== JSON.stringify(c.body))
              problems.push(`complete retried: ${again.status} ${JSON.stringify(again.body)}, first ${JSON.stringify(c.body)}`);
            // Released again later, so the pool keeps flowing.
            if (int(0, 1) === 0) {
              const rel = await apis[int(0, 1)].post(`/v1/pools/${pool}/resources/${l.taskId}/release`, { owner: name });
              if (rel.status !== 200) problems.push(`release of completed task ${l.taskId}: ${rel.status} ${JSON.stringify(rel.body)}`);
            }
          } else if (cAnswered < l.expiresAt - 20) {
            problems.push(`complete answered ${l.expiresAt - cAnswered} ms before expiresAt: ${c.status} ${JSON.stringify(c.body)}`);
          } else if (c.status !== 409 || !['HOLD_LOST', 'HOLD_EXPIRED'].includes(c.body.error.code)) {
            problems.push(`late complete: ${c.status} ${JSON.stringify(c.body)}`);
          }
        } else if (end < 8) {
          await sleep(int(0, 300));
          const aSent = Date.now();
          const ab = await apis[int(0, 1)].post(`/v1/tasks/${l.id}/abandon`);
          if (ab.status === 200) l.endSentAt = Math.min(l.endSentAt, aSent);
          else problems.push(`abandon: ${ab.status} ${JSON.stringify(ab.body)}`);
        } // else: the reviewer walks away and the lease expires.
      }
    };
    await Promise.all(['a', 'b', 'c', 'd', 'e', 'f'].map((n) => reviewer(`rv-${n}`)));

    // Exclusive hold: a lease answered while another lease of the task was surely live (answered, not yet past its
    // expiresAt, no complete or abandon of it sent yet) means two reviewers had the task at once.
    const byTask = new Map<string, Lease[]>();
    for (const l of leases) byTask.set(l.taskId, [...(byTask.get(l.taskId) ?? []), l]);
    for (const [task, ls] of byTask) {
      for (const first of ls) {
        const liveUntil = Math.min(first.expiresAt, first.endSentAt) - 50;
        for (const second of ls) {
          if (second !== first && second.sentAt > first.answeredAt && second.answeredAt < liveUntil)
            problems.push(
              `task ${task}: leased to ${second.reviewer} at ${second.sentAt}-${second.answeredAt} while ${first.reviewer}'s lease was live until ${liveUntil}`,
            );
        }
      }
    }
    expect(problems).toEqual([]);
    expect(leases.length).toBeGreaterThanOrEqual(6);

    // Everything ends: every lease expired or closed; nothing held, and nobody still counted against maxHoldsPerOwner.
    await sleep(Math.max(0, Math.max(...leases.map((l) => l.expiresAt)) + 2100 - Date.now()));
    const completed = leases.filter((l) => l.completed);
    const released = await world.query<{ n: string }>(`SELECT count(*) AS n FROM t_allocation_history WHERE action = 'release'`);
    const allocated = await world.query<{ n: string }>(`SELECT count(*) AS n FROM t_resource WHERE state = 2`);
    expect(await apis[0].stats(pool)).toEqual({ total: 5, free: 5 - Number(allocated[0].n), held: 0, allocated: Number(allocated[0].n) });
    const history = await world.query<{ reservation_id: string; resource_id: string; owner: string }>(
      `SELECT reservation_id, resource_id::text AS resource_id, owner FROM t_allocation_history WHERE action = 'allocate' ORDER BY id`,
    );
    expect(history.map((h) => `${h.reservation_id}:${h.resource_id}:${h.owner}`).sort()).toEqual(
      completed.map((l) => `${l.id}:${l.taskId}:${l.reviewer}`).sort(),
    );
    expect(Number(allocated[0].n)).toBe(completed.length - Number(released[0].n));
    // Each reviewer may lease maxHoldsPerOwner (2) tasks again, as far as tasks are free.
    // (Every task may be allocated now: free can be 0.)
    const free = 5 - Number(allocated[0].n);
    for (const name of ['rv-a', 'rv-b']) {
      const got = [];
      for (let k = 0; k < 2; k++) got.push(await apis[k].post(`/v1/pools/${pool}/tasks/next`, { reviewer: name, leaseMs: 60_000 }));
      const want = name === 'rv-a' ? Math.min(2, free) : Math.min(2, Math.max(0, free - 2));
      expect(
        got.filter((g) => g.status === 200),
        `${name}: ${JSON.stringify(got.map((g) => g.body))}`,
      ).toHaveLength(want);
    }
  }, 60_000);
});

describe('task calls once a closed record has left Redis', () => {
  // Closed reservations stay readable in Redis for 1 s only (the default is 24 h; a Redis wipe has the same effect).
  const world = new TestWorld('tretain', { RESERVATION_RETENTION_MS: '1000', IDEMPOTENCY_TTL_MS: '1000', REDIS_TIMEOUT_MS: '10000' });
  afterAll(() => world.cleanup());

  it('a reservation made through /reservations on a task pool stays no lease: complete and abandon answer 404 before and after', async () => {
    const a = await world.start();
    const b = await world.start();
    expect((await a.post('/v1/pools', { name: 'kept', kind: 'task' })).status).toBe(201);
    expect((await a.post('/v1/pools/kept/resources', { items: [{ value: 'task-1' }, { value: 'task-2' }] })).status).toBe(201);
    const r = await a.post('/v1/pools/kept/reservations', { owner: 'buyer', count: 1 });
    expect(r.status).toBe(201);
    const confirmed = await b.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(confirmed.status).toBe(200);
    const lease = await b.post('/v1/pools/kept/tasks/next', { reviewer: 'rv' });
    expect(lease.status).toBe(200);
    const done = await a.post(`/v1/tasks/${lease.body.leaseId}/complete`);
    expect(done.body).toEqual({ leaseId: lease.body.leaseId, resourceId: lease.body.resourceId, state: 'completed' });

    const calls = async (x: TestInstance, y: TestInstance) => ({
      complete: await x.post(`/v1/tasks/${r.body.id}/complete`),
      abandon: await y.post(`/v1/tasks/${r.body.id}/abandon`),
      heartbeat: await x.post(`/v1/tasks/${r.body.id}/heartbeat`, { leaseMs: 5000 }),
    });
    const before = await calls(a, b);
    expect(before.complete.status).toBe(404);
    expect(before.abandon.status).toBe(404);
    expect(before.heartbeat.status).toBe(404);

    await sleep(1600); // past the retention: both records are gone from Redis, the commits are in Postgres
    // A lease's completion is still answered as the first time (from its commit row).
    const again = await b.post(`/v1/tasks/${lease.body.leaseId}/complete`);
    expect(again.status).toBe(200);
    expect(again.body).toEqual(done.body);
    // The reservation is still no lease: the same calls must answer as they did (README: the task calls act on leases
    // only; a reservation made through /reservations, even on a task pool, is 404 RESERVATION_NOT_FOUND to them).
    const after = await calls(b, a);
    const answers = (x: typeof after) =>
      Object.fromEntries(Object.entries(x).map(([call, res]) => [call, { status: res.status, body: res.body }]));
    expect(answers(after)).toEqual(answers(before));
    // Nothing changed meanwhile.
    const rows = await world.query(`SELECT owner, state, version FROM t_resource ORDER BY owner`);
    expect(rows).toEqual([
      { owner: 'buyer', state: 2, version: 1 },
      { owner: 'rv', state: 2, version: 1 },
    ]);
  }, 30_000);

  it('a lease is no reservation: read, extend, confirm and DELETE through /reservations answer 404 while it is live, once completed, and after its record left Redis, and change nothing', async () => {
    const a = await world.start();
    expect((await a.post('/v1/pools', { name: 'leased', kind: 'task' })).status).toBe(201);
    expect((await a.post('/v1/pools/leased/resources', { items: [{ value: 'task-l' }] })).status).toBe(201);
    const lease = await a.post('/v1/pools/leased/tasks/next', { reviewer: 'rv', leaseMs: 60_000 });
    expect(lease.status).toBe(200);
    const { leaseId, resourceId } = lease.body;
    const calls = async () => ({
      read: (await a.get(`/v1/reservations/${leaseId}`)).status,
      extend: (await a.post(`/v1/reservations/${leaseId}/extend`, { ttlMs: 3_000_000 })).status,
      confirm: (await a.post(`/v1/reservations/${leaseId}/confirm`, { resourceIds: [resourceId] })).status,
      release: (await a.del(`/v1/reservations/${leaseId}`)).status,
    });
    const unknown = { read: 404, extend: 404, confirm: 404, release: 404 };
    expect(await calls()).toEqual(unknown);
    // The lease goes on: nothing allocated, and its reviewer's heartbeat and complete succeed.
    const beat = await a.post(`/v1/tasks/${leaseId}/heartbeat`, { leaseMs: 60_000 });
    expect(beat.status).toBe(200);
    expect((await world.query(`SELECT state FROM t_resource WHERE id = $1`, [resourceId]))[0].state).toBe(1);
    expect((await a.post(`/v1/tasks/${leaseId}/complete`)).status).toBe(200);
    expect(await calls()).toEqual(unknown);
    await sleep(1600); // past the retention: only the commit in Postgres is left
    expect(await calls()).toEqual(unknown);
    expect((await a.post(`/v1/tasks/${leaseId}/complete`)).status).toBe(200);
  }, 30_000);

  it('a one-item reservation confirmed by a version that did not record the kind of its commit is still a reservation once its record left Redis', async () => {
    const a = await world.start();
    expect((await a.post('/v1/pools', { name: 'older', kind: 'number' })).status).toBe(201);
    expect((await a.post('/v1/pools/older/resources', { items: [{ value: '13800000001' }] })).status).toBe(201);
    const r = await a.post('/v1/pools/older/reservations', { owner: 'u1' });
    const resourceIds = [r.body.items[0].resourceId];
    const confirmed = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds });
    expect(confirmed.status).toBe(200);
    // As that version wrote it (no kind: one item, as a lease has), and past the retention.
    await world.query(`UPDATE t_commit SET body = body - 'kind' WHERE reservation_id = $1`, [r.body.id]);
    await sleep(1600);
    expect((await a.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('confirmed');
    expect(await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds })).toEqual({ ...confirmed, headers: expect.anything() });
    expect((await a.del(`/v1/reservations/${r.body.id}`)).body.error.code).toBe('RESERVATION_CLOSED');
    expect((await a.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 5000 })).body.error.code).toBe('RESERVATION_CLOSED');
  }, 30_000);

  it('extend of a confirmed reservation and heartbeat of a completed lease answer 409 RESERVATION_CLOSED before and after', async () => {
    const a = await world.start();
    const b = await world.start();
    expect((await a.post('/v1/pools', { name: 'numbers', kind: 'number' })).status).toBe(201);
    expect((await a.post('/v1/pools/numbers/resources', { items: [{ value: '1001' }, { value: '1002' }] })).status).toBe(201);
    expect((await a.post('/v1/pools', { name: 'reviews', kind: 'task' })).status).toBe(201);
    expect((await a.post('/v1/pools/reviews/resources', { items: [{ value: 'task-1' }] })).status).toBe(201);
    const r = await a.post('/v1/pools/numbers/reservations', { owner: 'buyer', count: 2 });
    expect(r.status).toBe(201);
    expect((await b.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(200);
    const lease = await b.post('/v1/pools/reviews/tasks/next', { reviewer: 'rv' });
    expect(lease.status).toBe(200);
    expect((await a.post(`/v1/tasks/${lease.body.leaseId}/complete`)).status).toBe(200);

    const calls = async (x: TestInstance, y: TestInstance) => {
      const extend = await x.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 5000 });
      const heartbeat = await y.post(`/v1/tasks/${lease.body.leaseId}/heartbeat`, { leaseMs: 5000 });
      return [extend, heartbeat].map((res) => ({ status: res.status, code: res.body.error?.code }));
    };
    const before = await calls(a, b);
    expect(before).toEqual([
      { status: 409, code: 'RESERVATION_CLOSED' },
      { status: 409, code: 'RESERVATION_CLOSED' },
    ]);
    await sleep(1600); // past the retention: both records are gone from Redis, the commits are in Postgres
    // GET still shows it confirmed (from Postgres): "not found" from extend would contradict it.
    expect((await b.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('confirmed');
    expect(await calls(b, a)).toEqual(before);
    // Nothing changed meanwhile.
    const rows = await world.query(
      `SELECT p.name AS pool, r.owner, r.state, r.version FROM t_resource r JOIN t_pool p ON p.id = r.pool_id
        WHERE p.name IN ('numbers', 'reviews') ORDER BY p.name, r.state DESC`,
    );
    expect(rows).toEqual([
      { pool: 'numbers', owner: 'buyer', state: 2, version: 1 },
      { pool: 'numbers', owner: null, state: 1, version: 0 },
      { pool: 'reviews', owner: 'rv', state: 2, version: 1 },
    ]);
  }, 30_000);
});
