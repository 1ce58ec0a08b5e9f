import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { holdSnapshot } from '../support/hold-snapshot.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm, reserveWhenFree } from '../support/harness.js';

/** Every live hold in Redis, the items due reservations list but do not hold, and the ids in the free index. */
const liveHolds = (redis: Redis, prefix: string, pool: string) => holdSnapshot(redis, `${prefix}{${pool}}:`);

describe('invariants 1-4 checked against the stores', () => {
  const world = new TestWorld('invariants');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start({ COMMIT_WINDOW_MS: '1000' });
    b = await world.start({ COMMIT_WINDOW_MS: '1000' });
  });
  afterAll(() => world.cleanup());

  it('invariant 1: under churn with expiries, no item is ever under two live holds nor free while held', async () => {
    await seedPool(a, 'exclusive', numbers(80));
    const redis = a.app.get<Redis>(REDIS);
    const deadline = Date.now() + 3000;
    const violations: string[] = [];
    let samplesWithHolds = 0;
    const sampler = (async () => {
      while (Date.now() < deadline) {
        const { holders, free, lost } = await liveHolds(redis, world.prefix, 'exclusive');
        if (holders.size > 0) samplesWithHolds++;
        for (const entry of lost) violations.push(`item, reservation still due, holder: ${entry}`);
        for (const id of free) if (holders.has(id)) violations.push(`${id} free and held`);
        await sleep(20);
      }
    })();
    // Some reservations are confirmed late, after their expiry, when their other item may be someone else's.
    const late: Promise<unknown>[] = [];
    const clients = Array.from({ length: 20 }, async (_, c) => {
      let n = 0;
      while (Date.now() < deadline) {
        const api = c % 2 ? a : b;
        const r = await api.post('/v1/pools/exclusive/reservations', { owner: `c${c}`, count: 2, ttlMs: 1000 });
        if (r.status === 201 && n % 3 === 0) await api.del(`/v1/reservations/${r.body.id}`);
        else if (r.status === 201 && c < 5 && n % 3 === 1 && Date.now() < deadline - 2000) {
          const confirm = { resourceIds: [r.body.items[0].resourceId] };
          late.push(sleep(1000 + api.config.HOLD_GRACE_MS + 100).then(() => api.post(`/v1/reservations/${r.body.id}/confirm`, confirm)));
        }
        if (r.status === 201) n++;
        await sleep(10);
      }
    });
    await Promise.all([sampler, ...clients]);
    await Promise.all(late);
    expect(late.length).toBeGreaterThan(3);
    expect(samplesWithHolds).toBeGreaterThan(5);
    expect(violations).toEqual([]);
  });

  it('invariant 3: a confirm that arrives just before expiresAt succeeds, while others compete for the pool', async () => {
    await seedPool(a, 'honoured', numbers(3));
    const r = await a.post('/v1/pools/honoured/reservations', { owner: 'just-in-time', count: 3, ttlMs: 1000 });
    const hammer = (async () => {
      const stop = Date.now() + 1500;
      while (Date.now() < stop) await b.post('/v1/pools/honoured/reservations', { owner: 'rival', count: 1 });
    })();
    await sleep(Math.max(0, Date.parse(r.body.expiresAt) - Date.now() - 150));
    const confirmed = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[2].resourceId] });
    await hammer;
    expect(confirmed.status).toBe(200);
    const [row] = await world.query(`SELECT state, owner FROM t_resource WHERE id = $1`, [r.body.items[2].resourceId]);
    expect(row).toEqual({ state: 2, owner: 'just-in-time' });
  });

  it('invariant 3: a confirm that reaches Redis a little after expiresAt (a busy instance) still finds its hold, however hard others compete', async () => {
    await seedPool(a, 'graced', numbers(3));
    const grace = a.config.HOLD_GRACE_MS;
    expect(grace).toBeGreaterThanOrEqual(400);
    const r = await a.post('/v1/pools/graced/reservations', { owner: 'late-by-a-little', count: 3, ttlMs: 1000 });
    const expiresAt = Date.parse(r.body.expiresAt);
    const rivals: string[] = [];
    const hammer = (async () => {
      while (Date.now() < expiresAt + grace + 1000) {
        const t = await b.post('/v1/pools/graced/reservations', { owner: 'rival', count: 1, ttlMs: 60_000 });
        if (t.status === 201) rivals.push(t.body.items[0].resourceId);
      }
    })();
    // The request arrived in time; the instance reached Redis only half the grace after expiresAt.
    await sleep(expiresAt + grace / 2 - Date.now());
    const confirmed = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    await hammer;
    expect(confirmed.status, JSON.stringify(confirmed.body)).toBe(200);
    const [row] = await world.query(`SELECT state, owner FROM t_resource WHERE id = $1`, [r.body.items[0].resourceId]);
    expect(row).toEqual({ state: 2, owner: 'late-by-a-little' });
    // The two it released went to the rival at once (the grace does not hold up the rest of the pool).
    expect(rivals.sort()).toEqual([r.body.items[1].resourceId, r.body.items[2].resourceId].sort());
  });

  it('invariants 3 and 4: a confirm whose instance died after pinning is given up; the hold is due again, and a retry succeeds', async () => {
    await seedPool(a, 'died-pinned', numbers(2));
    const r = await a.post('/v1/pools/died-pinned/reservations', { owner: 'ghost', count: 2, ttlMs: 60_000 });
    // The instance pins the holds for its commit (window 1 s), then dies before reaching Postgres.
    const pinned = await a.app.get(HoldStore).pin('died-pinned', r.body.id, [r.body.items[0].resourceId], 1000);
    expect(pinned.status).toBe('pinned');
    await sleep(500);
    expect((await b.post('/v1/pools/died-pinned/reservations', { owner: 'rival', count: 1 })).status).toBe(409);
    const decided = async () =>
      (await world.query(`SELECT decision FROM t_commit_decision WHERE reservation_id = $1`, [r.body.id]))[0]?.decision;
    await eventually(decided, 4000);
    expect(await decided()).toBe('abort');
    expect((await b.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
    expect((await b.post('/v1/pools/died-pinned/reservations', { owner: 'rival', count: 1 })).status).toBe(409);
    const retry = await b.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(retry.status, JSON.stringify(retry.body)).toBe(200);
    expect((await b.get('/v1/pools/died-pinned')).body.stats).toEqual({ total: 2, free: 1, held: 0, allocated: 1 });
  });

  it("invariant 4: a confirm whose instance died after pinning, past the hold's expiry, returns the items to the pool", async () => {
    await seedPool(a, 'died-late', numbers(2));
    const r = await a.post('/v1/pools/died-late/reservations', { owner: 'ghost', count: 2, ttlMs: 1000 });
    const pinned = await a.app.get(HoldStore).pin('died-late', r.body.id, [r.body.items[0].resourceId], 1000);
    expect(pinned.status).toBe('pinned');
    const { elapsedMs } = await eventually(async () => (await b.get('/v1/pools/died-late')).body.stats.free === 2, 5000);
    expect(elapsedMs).toBeLessThan(3000);
    expect((await b.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('expired');
    const rows = await world.query(
      `SELECT count(*)::int AS n FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'died-late' AND r.state = 2`,
    );
    expect(rows[0].n).toBe(0);
  });

  it('a commit slower than its window cannot land after the sweeper gave it up', async () => {
    await seedPool(a, 'too-slow', numbers(1));
    const r = await a.post('/v1/pools/too-slow/reservations', { owner: 'slow', count: 1, ttlMs: 1000 });
    const id = r.body.items[0].resourceId;
    const slow = await stalledConfirm(a, 'too-slow', r.body.id, id, 1000);
    // The sweeper gives the epoch up and the item returns; a rival takes and confirms it.
    const rival = await reserveWhenFree(b, 'too-slow', 'rival');
    // Now the slow commit reaches Postgres, still with a valid version: the decision row refuses it.
    const late = await slow.land();
    expect(late).toBe('decided');
    const won = await b.post(`/v1/reservations/${rival.body.id}/confirm`, { resourceIds: [id] });
    expect(won.status).toBe(200);
    const [row] = await world.query(`SELECT owner, version FROM t_resource WHERE id = $1`, [id]);
    expect(row).toEqual({ owner: 'rival', version: 1 });
  });

  it('invariant 4: a confirm whose instance died after the Postgres commit is finished by the sweeper', async () => {
    await seedPool(a, 'died-committed', numbers(3));
    const r = await a.post('/v1/pools/died-committed/reservations', { owner: 'ghost', count: 3 });
    const chosen = r.body.items[1];
    const holds = a.app.get(HoldStore);
    const pinned = await holds.pin('died-committed', r.body.id, [chosen.resourceId], 1000);
    if (pinned.status !== 'pinned') throw new Error(`pin: ${pinned.status}`);
    const pool = await a.app.get(PoolRepository).findByName('died-committed');
    const body = {
      selection: [chosen.resourceId],
      allocated: [{ resourceId: chosen.resourceId, value: chosen.value, version: chosen.version + 1 }],
      released: r.body.items.filter((i: { resourceId: string }) => i !== chosen).map((i: { resourceId: string }) => i.resourceId),
      owner: 'ghost',
      items: [],
      expiresMs: Date.parse(r.body.expiresAt),
    };
    const committed = await a.app.get(ResourceRepository).allocate({
      poolId: pool!.id,
      owner: 'ghost',
      reservationId: r.body.id,
      epoch: pinned.reservation.epoch,
      generation: pinned.reservation.generation,
      items: [{ id: chosen.resourceId, version: chosen.version }],
      body: JSON.stringify(body),
    });
    expect(committed).toBe('committed');
    // ...and dies before its last Redis step. The sweeper finds the commit row and finishes it.
    await eventually(async () => (await b.get(`/v1/reservations/${r.body.id}`)).body.state === 'confirmed', 5000);
    expect((await b.get('/v1/pools/died-committed')).body.stats).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
    const retry = await b.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen.resourceId] });
    expect(retry.status).toBe(200);
    expect(retry.body.allocated).toEqual(body.allocated);
    const taken = [];
    for (;;) {
      const t = await b.post('/v1/pools/died-committed/reservations', { owner: 'next', count: 1 });
      if (t.status !== 201) break;
      taken.push(t.body.items[0].resourceId);
    }
    expect(taken.sort()).toEqual(body.released.sort());
  });
});
