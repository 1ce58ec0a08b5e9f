import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { Redis } from 'ioredis';
import { DomainError } from '../../src/common/errors.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { poolKeys } from '../../src/redis/keys.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { holdSnapshot } from '../support/hold-snapshot.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep } from '../support/harness.js';
import { deleteKeys } from '../support/services.js';

// Imports and releases of resources (the admin paths) racing purchases, Redis wipes and the other instance.
describe('imports and releases racing the hot paths', () => {
  const world = new TestWorld('admin-races');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start();
    b = await world.start();
  });
  afterAll(() => world.cleanup());

  /** On instance b: reserves and confirms `id` (the only free item of the pool), then wipes Redis and waits for the rebuild. */
  async function buyThenWipe(pool: string, id: string): Promise<void> {
    const r = await b.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer' });
    expect(r.status).toBe(201);
    expect((await b.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    await deleteKeys(a.config.REDIS_URL, world.prefix);
    await eventually(async () => (await b.app.get(HoldStore).rebuildState()) === 'rebuilt', 10_000);
  }

  /** The allocated item is neither in the free index nor handed out (invariant 5: a wipe puts back nothing allocated). */
  async function expectNotReservable(pool: string, id: string, value: string): Promise<void> {
    const client = new Redis(a.config.REDIS_URL);
    const inIndex = await client.zscore(poolKeys(world.prefix, pool).free, `${value}\0${id}`);
    client.disconnect();
    const next = await a.post(`/v1/pools/${pool}/reservations`, { owner: 'next' });
    expect({ inIndex, stats: await a.stats(pool), reserve: next.status }).toEqual({
      inIndex: null,
      stats: { total: 1, free: 0, held: 0, allocated: 1 },
      reserve: 409,
    });
  }

  it('a retried import that read the row free, then met a purchase and a Redis wipe, puts nothing back', async () => {
    await seedPool(a, 'gen-import', ['13900000001']);
    const [{ id }] = await world.query(`SELECT r.id::text FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'gen-import'`);
    const resources = a.app.get(ResourceRepository);
    const read = resources.findFreeByValues.bind(resources);
    // The import of a value already in the pool reads its row, free at version 0; before it reaches Redis, the
    // item is bought on b, and Redis is wiped and rebuilt (the generation moves on).
    const spy = vi.spyOn(resources, 'findFreeByValues').mockImplementationOnce(async (poolId, values) => {
      const rows = await read(poolId, values);
      await buyThenWipe('gen-import', id);
      return rows;
    });
    try {
      const again = await a.post('/v1/pools/gen-import/resources', { items: [{ value: '13900000001' }] });
      expect([again.status, again.body]).toEqual([201, { inserted: 0, duplicates: 1 }]);
    } finally {
      spy.mockRestore();
    }
    expect(await world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [id])).toEqual([
      { state: 2, version: 1, owner: 'buyer' },
    ]);
    await expectNotReservable('gen-import', id, '13900000001');
  });

  it('an import whose new row was indexed, bought and wiped by others before it reached Redis puts nothing back', async () => {
    await a.post('/v1/pools', { name: 'gen-insert', kind: 'number' });
    const resources = a.app.get(ResourceRepository);
    const insert = resources.insertMany.bind(resources);
    let id = '';
    const spy = vi.spyOn(resources, 'insertMany').mockImplementationOnce(async (poolId, items) => {
      const rows = await insert(poolId, items);
      id = rows[0].id;
      // The same import sent to b as well (a client's retry) indexes the row a inserted; it is bought there.
      expect((await b.post('/v1/pools/gen-insert/resources', { items: [{ value: '13900000002' }] })).body).toEqual({
        inserted: 0,
        duplicates: 1,
      });
      await buyThenWipe('gen-insert', id);
      return rows;
    });
    try {
      expect((await a.post('/v1/pools/gen-insert/resources', { items: [{ value: '13900000002' }] })).body).toEqual({
        inserted: 1,
        duplicates: 0,
      });
    } finally {
      spy.mockRestore();
    }
    await expectNotReservable('gen-insert', id, '13900000002');
  });

  it('a retried release (409 NOT_ALLOCATED, the row free) that met a purchase and a Redis wipe puts nothing back', async () => {
    await seedPool(a, 'gen-release', ['13900000003']);
    const r0 = await a.post('/v1/pools/gen-release/reservations', { owner: 'first' });
    const id = r0.body.items[0].resourceId;
    expect((await a.post(`/v1/reservations/${r0.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    expect((await b.post(`/v1/pools/gen-release/resources/${id}/release`, { owner: 'first' })).status).toBe(200);
    const resources = a.app.get(ResourceRepository);
    const find = resources.findById.bind(resources);
    // The owner's retry of that release, on a, reads the row (free, version 2), then the item is bought on b
    // and Redis is wiped and rebuilt before the retry reaches Redis.
    const spy = vi.spyOn(resources, 'findById').mockImplementationOnce(async (poolId, rid) => {
      const row = await find(poolId, rid);
      await buyThenWipe('gen-release', id);
      return row;
    });
    try {
      expect((await a.post(`/v1/pools/gen-release/resources/${id}/release`, { owner: 'first' })).body.error.code).toBe('NOT_ALLOCATED');
    } finally {
      spy.mockRestore();
    }
    expect(await world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [id])).toEqual([
      { state: 2, version: 3, owner: 'buyer' },
    ]);
    await expectNotReservable('gen-release', id, '13900000003');
  });

  it('an import that meets a wipe and a rebuild between its generation read and its insert still indexes its rows', async () => {
    await a.post('/v1/pools', { name: 'gen-new', kind: 'number' });
    const resources = a.app.get(ResourceRepository);
    const insert = resources.insertMany.bind(resources);
    // Redis is wiped and rebuilt (reading Postgres before the insert) while the import is on its way to Postgres.
    const spy = vi.spyOn(resources, 'insertMany').mockImplementationOnce(async (poolId, items) => {
      await deleteKeys(a.config.REDIS_URL, world.prefix);
      await eventually(async () => (await b.app.get(HoldStore).rebuildState()) === 'rebuilt', 10_000);
      return insert(poolId, items);
    });
    try {
      expect((await a.post('/v1/pools/gen-new/resources', { items: [{ value: '13900000004' }] })).body).toEqual({
        inserted: 1,
        duplicates: 0,
      });
    } finally {
      spy.mockRestore();
    }
    expect(await a.stats('gen-new')).toEqual({ total: 1, free: 1, held: 0, allocated: 0 });
    expect((await a.post('/v1/pools/gen-new/reservations', { owner: 'next' })).status).toBe(201);
  });

  it('a confirm whose Redis step failed (answered 200 all the same), then a release of the item: reservable again at once', async () => {
    await seedPool(a, 'late-finish', numbers(1));
    const r = await a.post('/v1/pools/late-finish/reservations', { owner: 'buyer' });
    const id = r.body.items[0].resourceId;
    // The Postgres commit lands; the finish script times out (a Redis blip): the buyer is answered 200.
    const fail = vi
      .spyOn(a.app.get(HoldStore), 'finish')
      .mockRejectedValueOnce(DomainError.unavailable('redis', new Error('Command timed out')));
    try {
      expect((await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    } finally {
      fail.mockRestore();
    }
    // The buyer gives the number back at once, on the other instance. API.md: "it can be reserved again at once".
    const released = await b.post(`/v1/pools/late-finish/resources/${id}/release`, { owner: 'buyer' });
    expect([released.status, released.body.state]).toEqual([200, 'free']);
    expect((await b.get(`/v1/pools/late-finish/resources/${id}`)).body.state).toBe('free');
    expect(await b.stats('late-finish')).toEqual({ total: 1, free: 1, held: 0, allocated: 0 });
    expect((await b.post('/v1/pools/late-finish/reservations', { owner: 'next' })).status).toBe(201);
  });

  it('imports, double releases, reserves, confirms and rebuilds on two instances at once: Redis and Postgres agree after', async () => {
    const pool = 'stress';
    await seedPool(a, pool, numbers(30, '1370000'));
    const client = new Redis(a.config.REDIS_URL);
    const base = poolKeys(world.prefix, pool).base;
    const deadline = Date.now() + 5000;
    const violations: string[] = [];
    const unexpected: string[] = [];
    const either = () => (Math.random() < 0.5 ? a : b);
    const sampler = (async () => {
      while (Date.now() < deadline) {
        const { holders, free, lost } = await holdSnapshot(client, base);
        for (const entry of lost) violations.push(`lost hold: ${entry}`);
        for (const id of free) if (holders.has(id)) violations.push(`${id} free and held`);
        await sleep(25);
      }
    })();
    let releasePairs = 0;
    const buyers = Array.from({ length: 10 }, async (_, c) => {
      while (Date.now() < deadline) {
        const r = await either().post(`/v1/pools/${pool}/reservations`, { owner: `o${c}`, count: 1 + (c % 2) });
        if (r.status !== 201) {
          if (r.body?.error?.code !== 'POOL_EXHAUSTED') unexpected.push(`reserve ${r.status} ${JSON.stringify(r.body)}`);
          await sleep(20);
          continue;
        }
        if (c % 5 === 0) {
          await either().del(`/v1/reservations/${r.body.id}`);
          continue;
        }
        const id = r.body.items[0].resourceId;
        const confirm = await either().post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] });
        if (confirm.status !== 200) {
          unexpected.push(`confirm ${confirm.status} ${JSON.stringify(confirm.body)}`);
          continue;
        }
        // A release sent to both instances at once (a retried release): one 200, one 409 NOT_ALLOCATED.
        const answers = await Promise.all([a, b].map((api) => api.post(`/v1/pools/${pool}/resources/${id}/release`, { owner: `o${c}` })));
        const statuses = answers.map((x) => x.status).sort();
        if (statuses[0] !== 200 || statuses[1] !== 409) unexpected.push(`release pair ${statuses.join(',')}`);
        releasePairs++;
      }
    });
    let imported = 0;
    const importer = (async () => {
      for (let round = 0; Date.now() < deadline; round++) {
        const values = numbers(5, `13${String(round).padStart(3, '0')}`).map((value) => ({ value }));
        // The same values on both instances, in opposite orders.
        const answers = await Promise.all([
          a.post(`/v1/pools/${pool}/resources`, { items: values }),
          b.post(`/v1/pools/${pool}/resources`, { items: [...values].reverse() }),
        ]);
        if (answers.some((x) => x.status !== 201)) unexpected.push(`import ${answers.map((x) => x.status).join(',')}`);
        else if (answers[0].body.inserted + answers[1].body.inserted !== 5)
          unexpected.push(`import ${JSON.stringify(answers.map((x) => x.body))}`);
        imported += 5;
        await sleep(150);
      }
    })();
    const rebuilder = (async () => {
      for (let i = 0; Date.now() < deadline - 1500; i++) {
        await (i % 2 ? a : b).app.get(RebuildService).rebuild('periodic');
        await sleep(100);
      }
    })();
    const readers = (async () => {
      while (Date.now() < deadline) {
        const s = await either().stats(pool);
        if (s.free < 0 || s.held < 0 || s.free + s.held + s.allocated !== s.total) unexpected.push(`stats ${JSON.stringify(s)}`);
        await sleep(30);
      }
    })();
    await Promise.all([sampler, ...buyers, importer, rebuilder, readers]);
    expect(releasePairs).toBeGreaterThan(10);
    expect({ violations, unexpected: unexpected.slice(0, 10) }).toEqual({ violations: [], unexpected: [] });
    // Quiet now, and no rebuild: within 2 s the free index is exactly the free rows of Postgres.
    const agreement = async () => {
      const rows = await world.query<{ id: string; state: number }>(
        `SELECT r.id::text AS id, r.state FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = $1`,
        [pool],
      );
      const { holders, free } = await holdSnapshot(client, base);
      const pgFree = rows
        .filter((row) => row.state === 1)
        .map((row) => row.id)
        .sort();
      const indexed = [...new Set(free)].sort();
      return {
        total: rows.length,
        held: holders.size,
        notFreeButIndexed: indexed.filter((id) => !pgFree.includes(id)),
        freeNotIndexed: pgFree.filter((id) => !indexed.includes(id)),
        free: pgFree.length,
      };
    };
    let last = await agreement();
    await eventually(async () => {
      last = await agreement();
      return last.held === 0 && last.notFreeButIndexed.length === 0 && last.freeNotIndexed.length === 0;
    }, 2000).catch(() => undefined);
    client.disconnect();
    expect(last).toMatchObject({ total: 30 + imported, held: 0, notFreeButIndexed: [], freeNotIndexed: [] });
    expect(await a.stats(pool)).toEqual({ total: last.total, free: last.free, held: 0, allocated: last.total - last.free });
  }, 60_000);
});
