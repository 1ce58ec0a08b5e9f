import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Redis } from 'ioredis';
import { SweeperService } from '../../src/sweeper/sweeper.service.js';
import { ADD_FREE_WRITES } from '../../src/redis/hold-store.repository.js';
import { OwnRedis } from '../support/services.js';
import { TestInstance, TestWorld, seedPool } from '../support/harness.js';

// What a filtered reserve costs Redis, counted in the commands its script calls rather than timed: this file
// runs a redis-server of its own, so nothing else adds to its command counts.
describe('filtered reserves: the work Redis does does not grow with the pool', () => {
  const SIZE = 10_000;
  let redis: OwnRedis;
  let world: TestWorld;
  let api: TestInstance;
  let client: Redis;

  beforeAll(async () => {
    redis = await OwnRedis.start();
    world = new TestWorld('filtercost', { REDIS_URL: redis.url });
    api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    // No sweep, wipe check or rebuild during a count.
    await api.app.get(SweeperService).onModuleDestroy();
    client = redis.client();
    // Even items: city bj, values 139...; odd ones: city sh, values 138...; tier gold on 2 items of every 10.
    await seedPool(
      api,
      'cities',
      Array.from({ length: SIZE }, (_, i) => ({
        value: `${i % 2 ? '138' : '139'}${String(i).padStart(8, '0')}`,
        attributes: { city: i % 2 ? 'sh' : 'bj', ...(i % 10 < 2 && { tier: 'gold' }) },
      })),
    );
  }, 60_000);
  afterAll(async () => {
    client?.disconnect();
    try {
      await world.cleanup();
    } finally {
      await redis?.stop();
    }
  });

  /** Commands Redis ran, by name, scripts' own calls included. */
  const commands = async (): Promise<Map<string, number>> => {
    const stats = new Map<string, number>();
    for (const [, name, calls] of (await client.info('commandstats')).matchAll(/cmdstat_([^:]+):calls=(\d+)/g))
      stats.set(name, Number(calls));
    return stats;
  };

  /** Reserves with this filter; returns the answer and the commands the script called (EVALSHA itself left out). */
  const reserveCounting = async (count: number, filter: object, pool = 'cities') => {
    const before = await commands();
    const answer = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'o', count, filter });
    const after = await commands();
    let called = 0;
    for (const [name, calls] of after) if (!['evalsha', 'info'].includes(name)) called += calls - (before.get(name) ?? 0);
    return { answer, called };
  };

  const cases = [
    { filter: { attributes: { city: 'bj' }, valuePrefix: '138' }, found: 0 }, // none: bj values start 139
    { filter: { attributes: { city: 'bj' }, valuePrefix: '13900001' }, found: 3 },
    { filter: { attributes: { city: 'bj', tier: 'gold' }, valuePrefix: '138' }, found: 0 },
    { filter: { attributes: { city: 'sh', tier: 'gold' }, valuePrefix: '1380000' }, found: 3 },
  ];

  it.each(cases)('$filter: at most a few dozen commands on a 10,000-item pool', async ({ filter, found }) => {
    const { answer, called } = await reserveCounting(3, filter);
    expect(answer.status).toBe(found ? 201 : 409);
    if (found) {
      const values: string[] = answer.body.items.map((item: { value: string }) => item.value);
      expect(values).toHaveLength(3);
      for (const value of values) expect(value.startsWith(filter.valuePrefix)).toBe(true);
      for (const item of answer.body.items) expect(item.attributes).toMatchObject(filter.attributes);
      expect((await api.del(`/v1/reservations/${answer.body.id}`)).status).toBe(200);
    }
    // Holding 3 items takes about 20 calls. Walking the 5,000 items of one city, or of one prefix, would take
    // hundreds.
    expect(called).toBeLessThanOrEqual(40);
  });

  it('an import of attribute-rich items is cut into scripts of a bounded size', async () => {
    // 600 items of 32 attributes (the most the API accepts): 500 of them in one script held Redis for 73-130 ms.
    const attributes = Object.fromEntries(Array.from({ length: 32 }, (_, k) => [`k${k}`, `v${k % 3}`]));
    expect((await api.post('/v1/pools', { name: 'rich', kind: 'number' })).status).toBe(201);
    const before = await commands();
    const items = Array.from({ length: 600 }, (_, i) => ({ value: `137${String(i).padStart(8, '0')}`, attributes }));
    expect((await api.post('/v1/pools/rich/resources', { items })).body).toEqual({ inserted: 600, duplicates: 0 });
    const after = await commands();
    let called = 0;
    for (const [name, calls] of after) if (!['evalsha', 'info', 'time'].includes(name)) called += calls - (before.get(name) ?? 0);
    const scripts = (after.get('evalsha') ?? 0) - (before.get('evalsha') ?? 0);
    // Every item's 32 attribute indexes were written, in scripts of about ADD_FREE_WRITES (plus two reads an item).
    expect(called).toBeGreaterThan(600 * 33);
    expect(called / scripts).toBeLessThan(ADD_FREE_WRITES * 1.2);
    expect(await api.stats('rich')).toEqual({ total: 600, free: 600, held: 0, allocated: 0 });
  });

  describe('a filter of several attributes that matches rarely, on a larger pool', () => {
    // 17,000 numbers starting with 5 have attribute a; 17,000 more, b and c; 300 starting with 6 have a and b, and
    // the first 100 of them c too. So a and b share 300 items and a and c 100, none of which starts with 5.
    beforeAll(async () => {
      const five = (i: number) => `5${String(i).padStart(10, '0')}`;
      await seedPool(api, 'sparse', [
        ...Array.from({ length: 17_000 }, (_, i) => ({ value: five(i), attributes: { a: 'x' } })),
        ...Array.from({ length: 17_000 }, (_, i) => ({ value: five(17_000 + i), attributes: { b: 'y', c: 'z' } })),
        ...Array.from({ length: 300 }, (_, i) => ({
          value: `6${String(i).padStart(10, '0')}`,
          attributes: { a: 'x', b: 'y', ...(i < 100 && { c: 'z' }) },
        })),
      ]);
    }, 120_000);

    it('with a prefix none of their few shared items has: answered from the intersection, without walking an index', async () => {
      const { answer, called } = await reserveCounting(1, { attributes: { a: 'x', c: 'z' }, valuePrefix: '5' }, 'sparse');
      expect(answer.status).toBe(409);
      expect(answer.body.error.code).toBe('POOL_EXHAUSTED');
      expect(answer.body.error.details.searchLimited).toBeUndefined();
      // 4 windows of 64, then the intersection (100 members) read whole. Walking the 17,000 would take hundreds.
      expect(called).toBeLessThanOrEqual(40);
    });

    it('with a prefix none of their many shared items has: the walk stops at its limit, and the answer says so', async () => {
      const { answer, called } = await reserveCounting(1, { attributes: { a: 'x', b: 'y' }, valuePrefix: '5' }, 'sparse');
      expect(answer.status).toBe(409);
      expect(answer.body.error.code).toBe('POOL_EXHAUSTED');
      expect(answer.body.error.details).toMatchObject({ searchLimited: true, count: 1 });
      // 32,768 lookups over 2 indexes: 256 windows of 64 members, about three calls each, of the 266 there are.
      expect(called).toBeLessThanOrEqual(256 * 3 + 20);
    });

    it('finds the items the filter does match', async () => {
      const { answer } = await reserveCounting(3, { attributes: { a: 'x', c: 'z' }, valuePrefix: '6' }, 'sparse');
      expect(answer.status).toBe(201);
      for (const item of answer.body.items) expect(item.attributes).toEqual({ a: 'x', b: 'y', c: 'z' });
      const both = await reserveCounting(3, { attributes: { a: 'x', c: 'z' } }, 'sparse');
      expect(both.answer.status).toBe(201);
      for (const item of both.answer.body.items) expect(item.value.startsWith('6')).toBe(true);
    });
  });
});
