import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { freeMember, poolKeys } from '../../src/redis/keys.js';
import { TestInstance, TestWorld, numbers, seedPool, sleep, stalledConfirm } from '../support/harness.js';

/**
 * Redis writes that arrive late (an instance paused between reading Postgres and writing Redis, a finish
 * run a second time) must not undo what happened to an item meanwhile: a hold taken on what they leave
 * behind would carry a stale version, and its confirm, made in time, would fail (invariant 3).
 */
describe('late Redis writes never set an item back', () => {
  const world = new TestWorld('late');
  let api: TestInstance;

  beforeAll(async () => {
    // The sweeper's steps are played by hand here.
    api = await world.start({ SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(() => world.cleanup());

  /** Reserves the item of value `value` for `owner`, confirms it, and releases it: its version goes up by 2. */
  const roundTrip = async (pool: string, value: string, owner: string) => {
    const r = await api.post(`/v1/pools/${pool}/reservations`, { owner, count: 1, filter: { valuePrefix: value } });
    expect(r.status).toBe(201);
    const id = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    expect((await api.post(`/v1/pools/${pool}/resources/${id}/release`, { owner })).status).toBe(200);
  };

  /**
   * Two items x and y held by r1, which expired; x went round once (version 2); a late confirm of r1 on y pinned
   * it, and the sweeper settling that epoch has Postgres' abort and has read x (at version 2) after Redis' clock
   * said `readAt`. Its abort script has not reached Redis yet (the instance paused): `abort()` sends it.
   */
  async function abortAboutToLand(pool: string) {
    await seedPool(api, pool, numbers(2));
    const holds = api.app.get(HoldStore);
    const resources = api.app.get(ResourceRepository);
    const poolId = (await api.app.get(PoolRepository).findByName(pool))!.id;
    const r1 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r1', count: 2, ttlMs: 1000 });
    const [x, y] = r1.body.items as { resourceId: string; value: string }[];
    await sleep(1700);
    await holds.sweep(pool, 100, 15_000, 2000); // r1 expired: x and y are free
    await roundTrip(pool, x.value, 'r2'); // x: version 2
    const { pinned } = await stalledConfirm(api, pool, r1.body.id, y.resourceId, 200);
    const epoch = pinned.reservation.epoch;
    expect(await resources.decideAbort(r1.body.id, epoch)).toBe('abort');
    const readAt = await holds.clock();
    const xRow = (await resources.findMany(poolId, [x.resourceId]))[0];
    expect(xRow.version).toBe(2);
    const abort = () => holds.abort(pool, r1.body.id, epoch, readAt, [], [{ id: x.resourceId, v: x.value, n: xRow.version }]);
    return { x, abort };
  }

  it("an abort's re-cache of an item from a stale read does not replace a newer cache entry", async () => {
    const pool = 'late-abort';
    const { x, abort } = await abortAboutToLand(pool);
    await roundTrip(pool, x.value, 'r3'); // meanwhile x goes round again: version 4
    await abort();
    // The next buyer holds x at the version Postgres has, and its confirm lands.
    const r4 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r4', count: 1, filter: { valuePrefix: x.value } });
    expect(r4.body.items[0]).toMatchObject({ resourceId: x.resourceId, version: 4 });
    expect((await api.post(`/v1/reservations/${r4.body.id}/confirm`, { resourceIds: [x.resourceId] })).status).toBe(200);
  });

  it('an abort does not cache again, nor free, an item allocated after Postgres was read', async () => {
    const pool = 'late-abort-allocated';
    const { x, abort } = await abortAboutToLand(pool);
    // Meanwhile x is allocated: version 3, and its tombstone.
    const r3 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r3', count: 1, filter: { valuePrefix: x.value } });
    expect((await api.post(`/v1/reservations/${r3.body.id}/confirm`, { resourceIds: [x.resourceId] })).status).toBe(200);
    await abort();
    expect(await api.app.get(HoldStore).holder(pool, x.resourceId)).toBe('A:3');
    const client = new Redis(api.config.REDIS_URL);
    try {
      expect(await client.hget(poolKeys(world.prefix, pool).itemBucket(x.resourceId), x.resourceId)).toBeNull();
    } finally {
      client.disconnect();
    }
    const again = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r4', count: 1, filter: { valuePrefix: x.value } });
    expect(again.status).toBe(409);
  });

  it('a finish run again late does not replace a newer allocation tombstone: a rebuild page read before that allocation adds nothing', async () => {
    const pool = 'late-finish';
    await seedPool(api, pool, numbers(1));
    const holds = api.app.get(HoldStore);
    const r1 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r1', count: 1 });
    const x = r1.body.items[0] as { resourceId: string; value: string };
    expect((await api.post(`/v1/reservations/${r1.body.id}/confirm`, { resourceIds: [x.resourceId] })).status).toBe(200);
    expect((await api.post(`/v1/pools/${pool}/resources/${x.resourceId}/release`, { owner: 'r1' })).status).toBe(200);
    // A rebuild reads x free at version 2...
    const generation = await api.app.get(GenerationRepository).current();
    const readAt = await holds.clock();
    // ...x is allocated again (version 3), and r1's finish runs once more (the sweeper finishing it from its commit row).
    const r2 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r2', count: 1 });
    expect((await api.post(`/v1/reservations/${r2.body.id}/confirm`, { resourceIds: [x.resourceId] })).status).toBe(200);
    expect(await holds.holder(pool, x.resourceId)).toBe('A:3');
    await holds.finish(pool, r1.body.id, [{ resourceId: x.resourceId, value: x.value, version: 1 }], '{}');
    expect(await holds.holder(pool, x.resourceId)).toBe('A:3');
    // The rebuild's page reaches Redis: x must not be handed out, it is allocated.
    expect(await holds.addFree(pool, generation, readAt, [{ id: x.resourceId, v: x.value, n: 2 }])).toBe(0);
    expect((await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r3', count: 1 })).status).toBe(409);
  });

  it('a finish for a reservation Redis no longer has takes the allocated item out of the free index', async () => {
    const pool = 'late-finish-gone';
    await seedPool(api, pool, numbers(1));
    const holds = api.app.get(HoldStore);
    const r1 = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r1', count: 1 });
    const x = r1.body.items[0] as { resourceId: string; value: string; version: number };
    // Redis lost r1 (a wipe, then a rebuild that read x free before r1's commit landed in Postgres): x is in the
    // free index again and r1's record is gone. The sweeper then finishes r1's commit from its commit row.
    const keys = poolKeys(world.prefix, pool);
    const client = new Redis(api.config.REDIS_URL);
    try {
      await client.del(keys.reservation(r1.body.id), keys.hold(x.resourceId));
      await client.zadd(keys.free, 0, freeMember(x.value, x.resourceId));
      await holds.finish(pool, r1.body.id, [{ resourceId: x.resourceId, value: x.value, version: x.version + 1 }], '{}');
      expect(await client.zscore(keys.free, freeMember(x.value, x.resourceId))).toBeNull();
    } finally {
      client.disconnect();
    }
    expect(await holds.holder(pool, x.resourceId)).toBe(`A:${x.version + 1}`);
    expect((await api.post(`/v1/pools/${pool}/reservations`, { owner: 'r2', count: 1 })).status).toBe(409);
  });
});
