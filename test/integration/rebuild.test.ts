import { Logger } from '@nestjs/common';
import { afterAll, beforeAll, beforeEach, describe, expect, it, onTestFinished, vi } from 'vitest';
import { AttributesAreStrings1764300000000 } from '../../migrations/1764300000000-AttributesAreStrings.js';
import { runMigrations } from '../../src/database/migrate.js';
import { JobMutexRepository } from '../../src/database/job-mutex.repository.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { markerKey, poolKeys, rebuildRunKey } from '../../src/redis/keys.js';
import { HoldStore, READ_MAX_AGE_MS, TOMBSTONE_MS } from '../../src/redis/hold-store.repository.js';
import { TestInstance, TestWorld, eventually, numbers, quietSweepers, seedPool, staleReadAt } from '../support/harness.js';
import { deleteKeys } from '../support/services.js';

describe('rebuild of Redis from Postgres, one instance at a time', () => {
  const world = new TestWorld('rebuild');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    b = await world.start({ RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(() => world.cleanup());
  // A test starts once the last one's rebuilds are over: a sweeper finishes an unfinished one on its own.
  beforeEach(async () => {
    await eventually(async () => {
      const holders = await world.query(`SELECT 1 FROM t_job_mutex WHERE job_type = 'rebuild' AND holder IS NOT NULL`);
      return holders.length === 0 && (await a.app.get(HoldStore).rebuildState()) === 'rebuilt';
    }, 15_000);
  });

  /**
   * For a test that stalls a rebuild by hand past its lease: the sweepers may not take the job over meanwhile (a
   * marker that says rebuilding and a stale lease are theirs to finish), until the test is over.
   */
  const quietBoth = () => quietSweepers(a, b);

  it('t_job_mutex: the version CAS lets one holder in, until it releases or its lease runs out', async () => {
    const mutex = a.app.get(JobMutexRepository);
    expect(await mutex.acquire('test-job', 'instance-a', 60_000)).not.toBeNull();
    expect(await mutex.acquire('test-job', 'instance-b', 60_000)).toBeNull();
    expect(await mutex.acquire('test-job', 'instance-a', 60_000)).not.toBeNull(); // renewal by the holder
    await mutex.release('test-job', 'instance-a');
    const held = await mutex.acquire('test-job', 'instance-b', 60_000);
    expect(held).not.toBeNull();
    const renewed = await mutex.renew('test-job', 'instance-b', held!);
    expect(renewed).not.toBeNull();
    await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'test-job'`);
    expect(await mutex.acquire('test-job', 'instance-c', 60_000)).not.toBeNull(); // the stale holder is replaced
    // Back from its stall, the old holder cannot renew: not while the new one holds the job, nor once it released it.
    expect(await mutex.renew('test-job', 'instance-b', renewed!)).toBeNull();
    await mutex.release('test-job', 'instance-c');
    expect(await mutex.renew('test-job', 'instance-b', renewed!)).toBeNull();
    const [row] = await world.query(`SELECT holder, version::int AS version FROM t_job_mutex WHERE job_type = 'test-job'`);
    expect(row).toEqual({ holder: null, version: 7 });
  });

  it('an instance that saw Redis wiped does not rebuild (nor fence holds) again once another instance has rebuilt', async () => {
    const before = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    // The marker is present: somebody already rebuilt after the wipe this instance noticed.
    expect(await b.app.get(RebuildService).rebuild('wiped')).toBe(0);
    expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual(before);
  });

  it('a rebuild whose every round finds a pool without its generation (Redis losing keys) stops after 5 rounds, unfinished', async () => {
    await seedPool(a, 'keys-lost', numbers(1));
    quietBoth();
    const holds = a.app.get(HoldStore);
    const written = vi.spyOn(holds, 'setGeneration').mockResolvedValue(false);
    onTestFinished(() => written.mockRestore());
    await expect(a.app.get(RebuildService).rebuild('startup')).rejects.toThrow(/during each of 5 rebuild rounds/);
    // The first round in the current generation, the four after it each in a new one.
    expect(new Set(written.mock.calls.map(([, generation]) => generation)).size).toBe(5);
    expect(await holds.rebuildState()).toBe('unfinished');
  });

  it('concurrent attempts elect exactly one instance', async () => {
    const attempts = await Promise.all(
      Array.from({ length: 10 }, (_, i) => (i % 2 ? a : b).app.get(JobMutexRepository).acquire('race', `i-${i}`, 60_000)),
    );
    expect(attempts.filter(Boolean)).toHaveLength(1);
  });

  it('re-adds free rows missing from Redis, skips held and allocated ones, and runs on one instance at a time', async () => {
    await seedPool(a, 'rebuilt', numbers(6));
    const held = await a.post('/v1/pools/rebuilt/reservations', { owner: 'h', count: 2 });
    const bought = await a.post('/v1/pools/rebuilt/reservations', { owner: 'b', count: 1 });
    await a.post(`/v1/reservations/${bought.body.id}/confirm`, { resourceIds: [bought.body.items[0].resourceId] });
    // Drop the free index only: three free items are now missing from Redis.
    const redis = (await import('ioredis')).Redis;
    const client = new redis(a.config.REDIS_URL);
    await client.del(`${world.prefix}{rebuilt}:free`);
    client.disconnect();
    expect((await a.get('/v1/pools/rebuilt')).body.stats.free).toBe(0);

    // While another instance holds the job, this one does not rebuild.
    const mutex = a.app.get(JobMutexRepository);
    expect(await mutex.acquire('rebuild', 'another-instance', 60_000)).not.toBeNull();
    expect(await b.app.get(RebuildService).rebuild('periodic')).toBeNull();
    expect((await a.get('/v1/pools/rebuilt')).body.stats.free).toBe(0);
    await mutex.release('rebuild', 'another-instance');
    expect(await b.app.get(RebuildService).rebuild('periodic')).toBe(3);
    expect((await a.get('/v1/pools/rebuilt')).body.stats).toEqual({ total: 6, free: 3, held: 2, allocated: 1 });
    const again = await a.post('/v1/pools/rebuilt/reservations', { owner: 'n', count: 3 });
    const heldIds = held.body.items.map((i: { resourceId: string }) => i.resourceId);
    for (const item of again.body.items) {
      expect(heldIds).not.toContain(item.resourceId);
      expect(item.resourceId).not.toBe(bought.body.items[0].resourceId);
    }
  });

  it('re-adds every free row of a pool larger than one page (ids read in numeric order, page after page)', async () => {
    // 12,000 rows: ids of one to five digits, more than two pages of the rebuild (5,000 rows each).
    await seedPool(a, 'paged', numbers(12_000));
    const redis = (await import('ioredis')).Redis;
    const client = new redis(a.config.REDIS_URL);
    try {
      await client.del(poolKeys(world.prefix, 'paged').free);
    } finally {
      client.disconnect();
    }
    expect(await b.app.get(RebuildService).rebuild('periodic')).toBe(12_000);
    expect((await a.get('/v1/pools/paged')).body.stats).toEqual({ total: 12_000, free: 12_000, held: 0, allocated: 0 });
  }, 30_000);

  it('a rebuild in the current generation that finds a generation key gone (wiped meanwhile) rebuilds in a new one', async () => {
    await seedPool(a, 'gen-gone', numbers(2));
    await seedPool(a, 'gen-kept', numbers(1));
    const [{ gen: before }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    try {
      // As if Redis was wiped after this rebuild wrote its marker: re-writing the old generation would let
      // holds be taken that the bump after the wipe fences.
      await client.del(`${world.prefix}{gen-gone}:gen`);
      expect(await b.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      const [{ gen: after }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
      expect(after).toBe(before + 1);
      expect(await client.get(`${world.prefix}{gen-gone}:gen`)).toBe(String(after));
      expect(await client.get(`${world.prefix}{gen-kept}:gen`)).toBe(String(after));
    } finally {
      client.disconnect();
    }
    expect((await a.post('/v1/pools/gen-gone/reservations', { owner: 'n', count: 2 })).status).toBe(201);
  });

  it('a rebuild whose lease ran out while it stalled, and that another instance took, stops: no bump fences live holds', async () => {
    quietBoth();
    await seedPool(a, 'stalled', numbers(3));
    const r = await a.post('/v1/pools/stalled/reservations', { owner: 'buyer', count: 1 });
    expect(r.status).toBe(201);
    const [{ gen: before }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const resources = b.app.get(ResourceRepository);
    const freePage = resources.freePage.bind(resources);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    // b reads its first page, then stalls for longer than its lease: a takes the job, rebuilds and lets it go.
    let markerOfA: string | null = null;
    const stall = vi.spyOn(resources, 'freePage').mockImplementationOnce(async (...args) => {
      await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'rebuild'`);
      expect(await a.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      markerOfA = await client.get(markerKey(world.prefix));
      return freePage(...args);
    });
    try {
      expect(await b.app.get(RebuildService).rebuild('periodic')).toBeNull();
      expect(stall).toHaveBeenCalled();
      // The marker b found at the end was a's, not its own: without its lease, that is no sign of a wipe.
      expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen: before }]);
      expect(markerOfA).toMatch(/^rebuilt:/);
      expect(await client.get(markerKey(world.prefix))).toBe(markerOfA);
    } finally {
      stall.mockRestore();
      client.disconnect();
    }
    // The hold taken before is still in the current generation: the buyer's confirm lands.
    const confirm = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(confirm.status).toBe(200);
  });

  it("another instance's marker, written during a rebuild (as one that stalled past its lease may), is not taken for a wipe", async () => {
    await seedPool(a, 'foreign-marker', numbers(2));
    const r = await a.post('/v1/pools/foreign-marker/reservations', { owner: 'buyer', count: 1 });
    const [{ gen: before }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const resources = b.app.get(ResourceRepository);
    const freePage = resources.freePage.bind(resources);
    const overwrite = vi.spyOn(resources, 'freePage').mockImplementationOnce(async (...args) => {
      await a.app.get(HoldStore).setMarker(`${before} rebuilding:another-instance:1:1`);
      return freePage(...args);
    });
    try {
      expect(await b.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      expect(overwrite).toHaveBeenCalled();
    } finally {
      overwrite.mockRestore();
    }
    expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen: before }]);
    // Not overwritten by this rebuild's end: the marker is the other instance's to finish.
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    try {
      expect(await client.get(markerKey(world.prefix))).toBe(`${before} rebuilding:another-instance:1:1`);
    } finally {
      client.disconnect();
    }
    expect((await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(200);
  });

  it('Redis wiped as a rebuild ends (after its last round, before its marker): no marker hides the wipe, and the next check rebuilds', async () => {
    await seedPool(a, 'wiped-at-end', numbers(3));
    const holds = b.app.get(HoldStore);
    const endRound = holds.endRebuildRound.bind(holds);
    const wipe = vi.spyOn(holds, 'endRebuildRound').mockImplementationOnce(async (run) => {
      const ended = await endRound(run);
      await deleteKeys(a.config.REDIS_URL, world.prefix); // a Redis restart: it keeps nothing
      return ended;
    });
    const [{ gen: before }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    try {
      expect(await b.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      expect(wipe).toHaveBeenCalled();
    } finally {
      wipe.mockRestore();
    }
    // With a marker, every sweeper would take this empty Redis for a rebuilt one (and the pool for an empty one)
    // until the periodic rebuild, which these instances never run. Without one, their next check rebuilds.
    const { value: rebuilt } = await eventually(async () => {
      const r = await a.post('/v1/pools/wiped-at-end/reservations', { owner: 'n', count: 3 });
      return r.status === 201 && r;
    }, 5000);
    expect(rebuilt.body.items).toHaveLength(3);
    expect(await holds.markerPresent()).toBe(true);
    const [{ gen: after }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    expect(after).toBe(before + 1);
  });

  it('a rebuild after a wipe that fails midway (a Postgres error on one page) is done again at once: every free item comes back', async () => {
    await seedPool(a, 'half-built', numbers(11_000));
    // The second page read of any instance's rebuild fails, as a statement timeout or a dropped connection would.
    let pages = 0;
    const spies = [a, b].map((instance) => {
      const repo = instance.app.get(ResourceRepository);
      const read = repo.freePage.bind(repo);
      return vi.spyOn(repo, 'freePage').mockImplementation(async (...args: Parameters<typeof repo.freePage>) => {
        if (++pages === 2) throw new Error('Connection terminated unexpectedly');
        return read(...args);
      });
    });
    try {
      await deleteKeys(a.config.REDIS_URL, world.prefix);
      // RECONCILE_INTERVAL_MS is 0: no periodic rebuild would ever finish it.
      await eventually(async () => (await a.stats('half-built')).free === 11_000, 15_000);
      expect(pages).toBeGreaterThan(2);
    } finally {
      for (const spy of spies) spy.mockRestore();
    }
    expect(await a.stats('half-built')).toEqual({ total: 11_000, free: 11_000, held: 0, allocated: 0 });
    // Marked rebuilt once the other pools of this file are done too (this one may not be the last).
    await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt', 5000);
  }, 30_000);

  it('a rebuild whose instance died midway (the marker says rebuilding, nobody holds the job) is finished by another', async () => {
    await seedPool(a, 'orphaned', numbers(4));
    const [{ gen }] = await world.query(`SELECT gen::text AS gen FROM t_redis_generation`);
    const client = new (await import('ioredis')).Redis(a.config.REDIS_URL);
    try {
      // What a rebuild leaves when its process is killed after its round began and before this pool was read.
      await client.set(markerKey(world.prefix), `${gen} rebuilding:dead-instance:0:1`);
      await client.del(poolKeys(world.prefix, 'orphaned').free);
    } finally {
      client.disconnect();
    }
    const { value } = await eventually(async () => {
      const r = await a.post('/v1/pools/orphaned/reservations', { owner: 'n', count: 4 });
      return r.status === 201 && r;
    }, 5000);
    expect(value.body.items).toHaveLength(4);
    // Marked rebuilt once the other pools of this file are done too (this one may not be the last).
    await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt', 5000);
    // In the generation it began in: holds taken since it began stay valid.
    expect(await world.query(`SELECT gen::text AS gen FROM t_redis_generation`)).toEqual([{ gen }]);
  });

  it('finishing a rebuild that died while giving the pools a new generation (after a wipe) gives the rest that generation: live holds stay valid', async () => {
    await seedPool(a, 'live-hold', numbers(2));
    await seedPool(a, 'no-generation-yet', numbers(2));
    const held = await a.post('/v1/pools/live-hold/reservations', { owner: 'buyer', count: 1, ttlMs: 600_000 });
    expect(held.status).toBe(201);
    const [{ gen }] = await world.query(`SELECT gen::text AS gen FROM t_redis_generation`);
    const client = new (await import('ioredis')).Redis(a.config.REDIS_URL);
    try {
      // What a round after a wipe (it bumped the generation) leaves when it dies inside its loop over the pools'
      // generation keys: its marker, its round key, and a pool without a key yet (nothing in it can be held).
      const round = 'dead-instance:0:1:fresh';
      await client.set(markerKey(world.prefix), `${gen} rebuilding:${round}`);
      await client.set(rebuildRunKey(world.prefix, round), '1');
      await client.del(poolKeys(world.prefix, 'no-generation-yet').generation);
    } finally {
      client.disconnect();
    }
    await eventually(async () => (await a.stats('no-generation-yet')).free === 2, 5000);
    await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt', 5000);
    expect(await world.query(`SELECT gen::text AS gen FROM t_redis_generation`)).toEqual([{ gen }]);
    const confirm = await a.post(`/v1/reservations/${held.body.id}/confirm`, { resourceIds: [held.body.items[0].resourceId] });
    expect(confirm.status).toBe(200);
  });

  it('finishing an unfinished rebuild that finds a pool without a generation key, with no sign it died mid-way through them, rebuilds in a new generation', async () => {
    await seedPool(a, 'key-lost', numbers(2));
    const [{ gen }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const client = new (await import('ioredis')).Redis(a.config.REDIS_URL);
    try {
      // A round in the current generation (no bump) whose round key is gone: the missing key may be a wipe's.
      await client.set(markerKey(world.prefix), `${gen} rebuilding:dead-instance:0:1:current`);
      await client.del(poolKeys(world.prefix, 'key-lost').generation);
    } finally {
      client.disconnect();
    }
    await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt', 5000);
    expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen: gen + 1 }]);
    expect((await a.stats('key-lost')).free).toBe(2);
  });

  it('a rebuild that stalled past its lease cannot bump the generation: the bump renews the lease in its transaction', async () => {
    await seedPool(a, 'fenced-bump', numbers(2));
    const genKey = poolKeys(world.prefix, 'fenced-bump').generation;
    const [{ gen: before }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    const generations = b.app.get(GenerationRepository);
    const bump = generations.bump.bind(generations);
    // The pool's generation key is gone (a wipe, as far as b can tell), so b's rebuild starts a round in a new
    // generation. Right before the bump, whatever b checked before, b stalls past its lease and another instance
    // takes the job.
    const stall = vi.spyOn(generations, 'bump').mockImplementationOnce(async (fence) => {
      await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'rebuild'`);
      expect(await a.app.get(JobMutexRepository).acquire('rebuild', 'another-instance', 60_000)).not.toBeNull();
      return bump(fence);
    });
    try {
      await client.del(genKey);
      expect(await b.app.get(RebuildService).rebuild('periodic')).toBeNull();
      expect(stall).toHaveBeenCalled();
      expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen: before }]);
    } finally {
      stall.mockRestore();
      await a.app.get(JobMutexRepository).release('rebuild', 'another-instance');
      await client.set(genKey, String(before));
      client.disconnect();
    }
    expect((await a.post('/v1/pools/fenced-bump/reservations', { owner: 'n', count: 2 })).status).toBe(201);
    // Nor can it put back an older generation than a newer rebuild wrote, in any mode.
    const holds = a.app.get(HoldStore);
    for (const mode of ['always', 'ifPresent'] as const) expect(await holds.setGeneration('fenced-bump', before - 1, mode)).toBe(false);
    expect(await holds.setGeneration('fenced-bump', before, 'ifPresent')).toBe(true);
    const check = new (await import('ioredis')).Redis(a.config.REDIS_URL);
    expect(await check.get(genKey)).toBe(String(before));
    check.disconnect();
  });

  it('a rebuild whose pages keep reaching Redis too late (it keeps stalling) stops once another instance took the job', async () => {
    quietBoth();
    await seedPool(a, 'always-late', numbers(2));
    const holds = b.app.get(HoldStore);
    const addFree = holds.addFree.bind(holds);
    let refused = 0;
    // Every page of this pool arrives too long after its read; after the first one, b's lease runs out and a takes the job.
    const late = vi.spyOn(holds, 'addFree').mockImplementation(async (pool, generation, readAt, items) => {
      if (pool !== 'always-late') return addFree(pool, generation, readAt, items);
      if (refused++ === 0) {
        await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'rebuild'`);
        expect(await a.app.get(JobMutexRepository).acquire('rebuild', 'another-instance', 60_000)).not.toBeNull();
      }
      return addFree(pool, generation, staleReadAt(readAt), items);
    });
    try {
      // Reading the page again and again, b still renews its lease now and then: it finds the job gone and stops.
      const rebuild = b.app.get(RebuildService).rebuild('periodic');
      let timer: NodeJS.Timeout | undefined;
      const outcome = await Promise.race([rebuild, new Promise((r) => (timer = setTimeout(() => r('still reading'), 15_000)))]);
      clearTimeout(timer);
      expect(outcome).toBeNull();
      expect(refused).toBeGreaterThan(1);
      const [row] = await world.query(`SELECT holder FROM t_job_mutex WHERE job_type = 'rebuild'`);
      expect(row).toEqual({ holder: 'another-instance' });
    } finally {
      late.mockRestore();
      await a.app.get(JobMutexRepository).release('rebuild', 'another-instance');
    }
  });

  it('a rebuild page that reaches Redis after an allocation it missed lost its tombstone (a stall) adds nothing, and is read again', async () => {
    quietBoth();
    await seedPool(a, 'late-page', numbers(3));
    const keys = poolKeys(world.prefix, 'late-page');
    const holds = b.app.get(HoldStore);
    const addFree = holds.addFree.bind(holds);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    let allocated = '';
    // b has read the pool's page (every item free) and stalls before it reaches Redis: meanwhile an item is
    // bought, and its allocation tombstone runs out, as it does after TOMBSTONE_MS.
    const late = vi.spyOn(holds, 'addFree').mockImplementation(async (pool, generation, readAt, items) => {
      if (pool !== 'late-page' || allocated) return addFree(pool, generation, readAt, items);
      const r = await a.post('/v1/pools/late-page/reservations', { owner: 'buyer', count: 1 });
      allocated = r.body.items[0].resourceId;
      expect((await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [allocated] })).status).toBe(200);
      expect(await client.get(keys.hold(allocated))).toMatch(/^A:/);
      await client.del(keys.hold(allocated));
      expect(items.map((item) => item.id)).toContain(allocated);
      // The read is older than the fence allows, and the tombstone it missed is gone: the fence must be shorter.
      expect(READ_MAX_AGE_MS).toBeLessThan(TOMBSTONE_MS);
      return addFree(pool, generation, staleReadAt(readAt), items);
    });
    try {
      expect(await b.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      expect(allocated).not.toBe('');
      // The late page added nothing; read again, it no longer lists the allocated item.
      const free = (await client.zrange(keys.free, 0, -1)).map((m) => m.split('\0')[1]);
      expect(free).toHaveLength(2);
      expect(free).not.toContain(allocated);
      // The fence itself, on a free item out of Redis: a read older than READ_MAX_AGE_MS adds nothing, a fresh one does.
      const [row] = await world.query(`SELECT id::text AS id, value, version FROM t_resource WHERE id = $1`, [free[0]]);
      const item = { id: row.id, v: row.value, n: row.version };
      await client.zrem(keys.free, `${row.value}\0${row.id}`);
      await client.hdel(keys.itemBucket(row.id), row.id);
      const generation = Number(await client.get(keys.generation));
      expect(await addFree('late-page', generation, staleReadAt(await holds.clock()), [item])).toBeNull();
      expect(await client.hget(keys.itemBucket(row.id), row.id)).toBeNull();
      expect(await addFree('late-page', generation, await holds.clock(), [item])).toBe(1);
      expect(await client.zcard(keys.free)).toBe(2);
    } finally {
      late.mockRestore();
      client.disconnect();
    }
  });

  it('an item under a live hold that has no cache entry (a new key layout) gets one, and is free again when the hold ends', async () => {
    await seedPool(a, 'uncached', numbers(1));
    const r = await a.post('/v1/pools/uncached/reservations', { owner: 'h', count: 1 });
    const id = r.body.items[0].resourceId;
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    try {
      await client.hdel(poolKeys(world.prefix, 'uncached').itemBucket(id), id);
    } finally {
      client.disconnect();
    }
    expect(await b.app.get(RebuildService).rebuild('periodic')).toBe(0); // held: not indexed
    expect((await a.del(`/v1/reservations/${r.body.id}`)).status).toBe(200);
    const again = await a.post('/v1/pools/uncached/reservations', { owner: 'n', count: 1 });
    expect(again.body.items?.[0]?.resourceId).toBe(id);
  });
  it('an upgrade from key layout 2 (attribute SETs) drops those sets and indexes attributes by value again', async () => {
    await seedPool(a, 'layout2', [
      { value: '13800000001', attributes: { city: 'bj' } },
      { value: '13900000002', attributes: { city: 'bj' } },
      { value: '13800000003', attributes: { city: 'sh' } },
    ]);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    const keys = poolKeys(world.prefix, 'layout2');
    const legacy = `${keys.base}fa:city\0bj`;
    try {
      // As an instance of the previous version leaves Redis: attributes in SETs, its own marker, no index of ours.
      const members = await client.zrange(keys.free, 0, -1);
      await client.sadd(legacy, ...members.filter((m) => !m.startsWith('13800000003')));
      await client.del(keys.attribute('city', 'bj'), keys.attribute('city', 'sh'), markerKey(world.prefix));
      await client.set(`${world.prefix}meta:rebuilt:2`, 'rebuilt by the version before');
      // Keys of this layout whose names merely contain "}:fa:" stay: an idempotency key, and a set named so.
      const idem = `${keys.base}idem:a}:fa:b`;
      const group = `${keys.base}fg:x}:fa:y`;
      await client.set(idem, 'kept');
      await client.sadd(group, 'kept');
      // The new version finds no marker of its layout: Redis counts as wiped.
      expect(await a.app.get(HoldStore).markerPresent()).toBe(false);
      // The items are in the free index already (its layout did not change); their attribute indexes are rebuilt.
      expect(await b.app.get(RebuildService).rebuild('wiped')).toBe(0);
      expect(await client.exists(legacy)).toBe(0);
      // Its marker goes too: that version, started here again (a rollback), finds none and rebuilds Redis.
      expect(await client.exists(`${world.prefix}meta:rebuilt:2`)).toBe(0);
      expect(await client.exists(idem, group)).toBe(2);
      expect(await client.zcard(keys.attribute('city', 'bj'))).toBe(2);
      expect(await client.zcard(keys.attribute('city', 'sh'))).toBe(1);
      const r = await a.post('/v1/pools/layout2/reservations', {
        owner: 'o',
        count: 1,
        filter: { attributes: { city: 'bj' }, valuePrefix: '139' },
      });
      expect(r.status).toBe(201);
      expect(r.body.items[0].value).toBe('13900000002');
    } finally {
      client.disconnect();
    }
  });

  it("an older key layout's marker is dropped by the next rebuild (so that version, started here again, rebuilds Redis), and is not taken for a wipe: live holds stay valid", async () => {
    await seedPool(a, 'old-marker', numbers(2));
    const held = await a.post('/v1/pools/old-marker/reservations', { owner: 'o' });
    expect(held.status).toBe(201);
    const [{ gen }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const { Redis } = await import('ioredis');
    const client = new Redis(a.config.REDIS_URL);
    try {
      // As the upgrade from layout 2 left layout 2's, and as a version of layout 1 started on this Redis writes its own.
      await client.set(`${world.prefix}meta:rebuilt:2`, 'rebuilt by the version before');
      await client.set(`${world.prefix}meta:rebuilt`, 'rebuilt by an older version');
      expect(await a.app.get(HoldStore).rebuildState()).toBe('rebuilt');
      expect(await b.app.get(RebuildService).rebuild('periodic')).not.toBeNull();
      expect(await client.exists(`${world.prefix}meta:rebuilt:2`, `${world.prefix}meta:rebuilt`)).toBe(0);
    } finally {
      client.disconnect();
    }
    expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen }]);
    expect((await a.post(`/v1/reservations/${held.body.id}/confirm`, { resourceIds: [held.body.items[0].resourceId] })).status).toBe(200);
  });

  describe('attributes that are not a flat object of strings', () => {
    const CONSTRAINT = 't_resource_attributes_strings';
    const BAD = ['{"n": 1}', '{"n": null}', '{"n": {"m": "x"}}', '{"n": true}', '{"n": ["x"]}', '["x"]', '"x"'];
    const validated = async () =>
      (await world.query(`SELECT convalidated FROM pg_constraint WHERE conname = $1`, [CONSTRAINT]))[0]?.convalidated;

    it('are refused by Postgres, whoever writes them', async () => {
      await seedPool(a, 'attrs-refused', numbers(1));
      const [{ id: poolId }] = await world.query(`SELECT id FROM t_pool WHERE name = 'attrs-refused'`);
      expect(await validated()).toBe(true);
      for (const [i, attributes] of BAD.entries()) {
        await expect(
          world.query(`INSERT INTO t_resource (pool_id, value, attributes) VALUES ($1, $2, $3::jsonb)`, [poolId, `bad-${i}`, attributes]),
        ).rejects.toMatchObject({ code: '23514', constraint: CONSTRAINT });
      }
      await world.query(`INSERT INTO t_resource (pool_id, value, attributes) VALUES ($1, 'good', '{"n": "1"}')`, [poolId]);
      expect(await b.app.get(RebuildService).rebuild('periodic')).toBe(1);
      expect((await a.get('/v1/pools/attrs-refused')).body.stats.free).toBe(2);
    });

    it('written before the constraint, leave the migration passing (NOT VALID) and are left out of a rebuild, which adds the rest', async () => {
      await seedPool(a, 'attrs-legacy', numbers(2));
      const [{ id: poolId }] = await world.query(`SELECT id FROM t_pool WHERE name = 'attrs-legacy'`);
      // A database from before the migration, with rows loaded in SQL.
      await world.query(`ALTER TABLE t_resource DROP CONSTRAINT ${CONSTRAINT}`);
      for (const [i, attributes] of BAD.entries()) {
        await world.query(`INSERT INTO t_resource (pool_id, value, attributes) VALUES ($1, $2, $3::jsonb)`, [
          poolId,
          `bad-${i}`,
          attributes,
        ]);
      }
      await world.query(`INSERT INTO t_resource (pool_id, value, attributes) VALUES ($1, 'loaded', '{"city": "bj"}')`, [poolId]);
      // The migration runs again, as at an instance's start, and Postgres' warning reaches the caller (the log).
      const migration = new AttributesAreStrings1764300000000().name;
      await world.query(`DELETE FROM typeorm_migrations WHERE name = $1`, [migration]);
      const notices: string[] = [];
      expect(await runMigrations(a.config, (message) => notices.push(message))).toEqual([migration]);
      expect(notices).toEqual([expect.stringContaining('some rows of t_resource have attributes that are not a flat object of strings')]);
      expect(await validated()).toBe(false); // new rows are still checked
      await expect(
        world.query(`INSERT INTO t_resource (pool_id, value, attributes) VALUES ($1, 'later', '{"n": 2}')`, [poolId]),
      ).rejects.toMatchObject({ code: '23514' });

      // The rebuild adds the loaded row (the two imported ones are there already), skips the seven it cannot
      // index, and names them.
      const warn = vi.spyOn(Logger.prototype, 'warn');
      try {
        expect(await b.app.get(RebuildService).rebuild('periodic')).toBe(1);
        const badIds = await world.query(`SELECT id FROM t_resource WHERE pool_id = $1 AND value LIKE 'bad-%' ORDER BY id`, [poolId]);
        const said = warn.mock.calls.map((call) => String(call[0])).filter((m) => m.includes('attrs-legacy'));
        expect(said).toHaveLength(1);
        expect(said[0]).toContain(`7 free row(s) left out of Redis`);
        for (const { id } of badIds) expect(said[0]).toContain(id);
      } finally {
        warn.mockRestore();
      }
      expect((await a.get('/v1/pools/attrs-legacy')).body.stats.free).toBe(3);
      const all = await a.post('/v1/pools/attrs-legacy/reservations', { owner: 'o', count: 3 });
      expect(all.status).toBe(201);
      expect(all.body.items.map((i: { value: string }) => i.value).sort()).toEqual([...numbers(2), 'loaded'].sort());
      expect((await a.post('/v1/pools/attrs-legacy/reservations', { owner: 'o', count: 1 })).status).toBe(409);
      await world.query(`DELETE FROM t_resource WHERE pool_id = $1 AND value LIKE 'bad-%'`, [poolId]);
      await world.query(`ALTER TABLE t_resource VALIDATE CONSTRAINT ${CONSTRAINT}`);
    });
  });
});
