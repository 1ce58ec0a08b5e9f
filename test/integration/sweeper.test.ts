import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { SweeperService } from '../../src/sweeper/sweeper.service.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { poolKeys } from '../../src/redis/keys.js';
import { SWEEP_BATCH, SWEEP_WORK_BUDGET } from '../../src/sweeper/sweep-limits.js';
import { TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';

describe('sweeper', () => {
  const world = new TestWorld('sweeper');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
    // The tests sweep by hand: the service's own timer is stopped, so that it cannot sweep first.
    await api.app.get(SweeperService).onModuleDestroy();
  });
  afterAll(() => world.cleanup());

  it('one tick returns every expired hold, however many sweep batches that takes', async () => {
    const n = Math.floor(SWEEP_BATCH * 2.5);
    await seedPool(api, 'bulk', numbers(n));
    for (let i = 0; i < n; i += 50) {
      const answers = await Promise.all(
        Array.from({ length: Math.min(50, n - i) }, () => api.post('/v1/pools/bulk/reservations', { owner: 'o', count: 1, ttlMs: 1000 })),
      );
      expect(answers.map((a) => a.status)).toEqual(answers.map(() => 201));
    }
    const stats = async () => (await api.get('/v1/pools/bulk')).body.stats;
    expect(await stats()).toEqual({ total: n, free: 0, held: n, allocated: 0 });
    await sleep(1200 + api.config.HOLD_GRACE_MS); // every hold has expired, and its grace has run out

    await api.app.get(SweeperService).tick();

    expect(await stats()).toEqual({ total: n, free: n, held: 0, allocated: 0 });
    expect((await api.get('/metrics')).body).toContain(`respool_expired_holds_total{pool="bulk"} ${n}`);
  });

  // Items of 4 attributes: freeing one takes 5 index writes.
  const attributed = (n: number) => numbers(n).map((value) => ({ value, attributes: { a: '1', b: '2', c: '3', d: '4' } }));
  const holdAndExpire = async (pool: string, reservations: number, count: number) => {
    for (let i = 0; i < reservations; i++) {
      expect((await api.post(`/v1/pools/${pool}/reservations`, { owner: 'o', count, ttlMs: 1000 })).status).toBe(201);
    }
    await sleep(1200 + api.config.HOLD_GRACE_MS);
  };

  it('a sweep call ends at its work budget and says more is due', async () => {
    await seedPool(api, 'budget', attributed(12));
    await holdAndExpire('budget', 4, 3); // 15 index writes a reservation
    const holds = api.app.get(HoldStore);
    const first = await holds.sweep('budget', SWEEP_BATCH, 15_000, 20);
    expect(first).toMatchObject({ expiredReservations: 2, freedItems: 6, more: true });
    const second = await holds.sweep('budget', SWEEP_BATCH, 15_000, 20);
    expect(second).toMatchObject({ expiredReservations: 2, freedItems: 6, more: false });
  });

  it('one tick goes on past batches cut short by the work budget', async () => {
    const reservations = Math.ceil((SWEEP_WORK_BUDGET * 1.5) / (20 * 5)); // 20 items of 5 writes each
    await seedPool(api, 'heavy', attributed(reservations * 20));
    await holdAndExpire('heavy', reservations, 20);
    await api.app.get(SweeperService).tick();
    expect((await api.get('/v1/pools/heavy')).body.stats).toMatchObject({ free: reservations * 20, held: 0 });
  });
  it('a reservation whose items are not a list of items (a hand edit) is expired without them, and expiry goes on past it', async () => {
    // With a quota, so that the reservations count against their owner (a pool without one counts nowhere).
    await seedPool(api, 'mangled', numbers(4), { maxHoldsPerOwner: 10 });
    const holds = [];
    for (let i = 0; i < 2; i++) holds.push(await api.post('/v1/pools/mangled/reservations', { owner: 'o', count: 2, ttlMs: 1000 }));
    const redis = new (await import('ioredis')).Redis(api.config.REDIS_URL);
    try {
      // The first to expire lists its first item without a value.
      const rkey = poolKeys(world.prefix, 'mangled').reservation(holds[0].body.id);
      const [first, second] = JSON.parse((await redis.hget(rkey, 'i'))!);
      await redis.hset(rkey, 'i', JSON.stringify([{ id: first.id, n: first.n }, second]));
    } finally {
      redis.disconnect();
    }
    await sleep(1200 + api.config.HOLD_GRACE_MS);

    await api.app.get(SweeperService).tick();

    // The other reservation's two items are free again, and the mangled one's well-formed item; the other
    // stays out until a rebuild. Both reservations stopped counting both their items against the owner.
    expect((await api.get('/v1/pools/mangled')).body.stats).toMatchObject({ free: 3 });
    expect((await api.get(`/v1/reservations/${holds[1].body.id}`)).body.state).toBe('expired');
    expect((await api.get(`/v1/reservations/${holds[0].body.id}`)).body.state).toBe('expired');
    const check = new (await import('ioredis')).Redis(api.config.REDIS_URL);
    try {
      expect(await check.hget(`${poolKeys(world.prefix, 'mangled').base}oh`, 'o')).toBeNull();
    } finally {
      check.disconnect();
    }
    expect(await api.app.get(RebuildService).rebuild('periodic')).toBe(1);
    expect((await api.get('/v1/pools/mangled')).body.stats).toMatchObject({ free: 4 });
  });
});

describe('sweeper at scale', () => {
  const world = new TestWorld('sweepscale');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start({ SWEEP_INTERVAL_MS: '250', HOLD_GRACE_MS: '500' });
  });
  afterAll(() => world.cleanup());

  it('invariant 4 with many pools and slow Redis round trips: every expired item is free within 2 s of its expiresAt', async () => {
    // 120 pools, and every sweep call 20 ms slower (Redis round trips under load): a pass over the pools one
    // after the other took 2.4 s by itself.
    const pools = Array.from({ length: 120 }, (_, i) => `scale-${i}`);
    for (let i = 0; i < pools.length; i += 20) {
      await Promise.all(pools.slice(i, i + 20).map((pool) => seedPool(api, pool, numbers(1))));
    }
    const holds = api.app.get(HoldStore);
    const sweep = holds.sweep.bind(holds);
    const slow = vi.spyOn(holds, 'sweep').mockImplementation(async (...args) => {
      await sleep(20);
      return sweep(...args);
    });
    try {
      const reserved = await Promise.all(pools.map((pool) => api.post(`/v1/pools/${pool}/reservations`, { owner: 'o', ttlMs: 1000 })));
      expect(reserved.map((r) => r.status)).toEqual(pools.map(() => 201));
      const expiresAt = new Map(pools.map((pool, i) => [pool, Date.parse(reserved[i].body.expiresAt)]));
      const redis = new Redis(api.config.REDIS_URL);
      const late = new Map<string, number>();
      try {
        while (late.size < pools.length && Date.now() < Math.max(...expiresAt.values()) + 5000) {
          const counts = await Promise.all(pools.map((pool) => redis.zcard(poolKeys(world.prefix, pool).free)));
          const now = Date.now();
          pools.forEach((pool, i) => {
            if (counts[i] === 1 && !late.has(pool)) late.set(pool, now - expiresAt.get(pool)!);
          });
          await sleep(25);
        }
      } finally {
        redis.disconnect();
      }
      expect(late.size).toBe(pools.length);
      expect(Math.max(...late.values())).toBeLessThanOrEqual(2000);
    } finally {
      slow.mockRestore();
    }
  }, 30_000);
});
