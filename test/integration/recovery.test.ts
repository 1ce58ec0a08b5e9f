import { Logger } from '@nestjs/common';
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { createApp } from '../../src/app.factory.js';
import { AppConfig } from '../../src/config/app-config.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm, reserveWhenFree } from '../support/harness.js';
import { OwnRedis, TcpProxy, freePort } from '../support/services.js';
import { StartupError } from '../../src/common/dependency-errors.js';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { HoldStore, PENDING_GENERATION_MS } from '../../src/redis/hold-store.repository.js';
import { makeReservationId, poolKeys } from '../../src/redis/keys.js';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { PoolCatalog } from '../../src/pools/pool-catalog.service.js';
import { DomainError } from '../../src/common/errors.js';

// Invariants 4, 5 and 6 under lost dependencies. This file runs its own redis-server, so it may
// flush, stop and restart it without touching the machine's Redis, and reaches Postgres through a
// proxy it can cut.
/**
 * createApp of a configuration it must refuse: its error. Should it start all the same, it is closed at once (its
 * pools and sweeper would outlive the test) and the promise rejects with "started", which no assertion expects.
 */
async function refusedStart(config: AppConfig): Promise<never> {
  const app = await createApp(config, { logger: false });
  await app.close();
  throw new Error('the instance started, though it should have refused to');
}

describe('recovery: Redis wiped or down, Postgres down, an instance gone', () => {
  let redis: OwnRedis;
  let world: TestWorld;
  let api: TestInstance;

  beforeAll(async () => {
    redis = await OwnRedis.start();
    world = new TestWorld('recovery', { REDIS_URL: redis.url });
    api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(async () => {
    try {
      await world.cleanup();
    } finally {
      await redis.stop();
    }
  });

  /**
   * Runs `test` with an instance whose Postgres connections go through a proxy it can cut or slow down, and stops
   * both after it. With `own`, the instance has a world of its own (a database and Redis keys): the file's other
   * instance, whose Postgres answers, must neither settle its work nor take its pools, whose generation keys it does
   * not see, for pools Redis lost (a rebuild in a new generation, which would fence its holds).
   */
  async function behindPostgresProxy(
    env: Record<string, string>,
    own: string | undefined,
    test: (services: { proxy: TcpProxy; viaProxy: TestInstance; world: TestWorld }) => Promise<void>,
  ): Promise<void> {
    const proxy = await TcpProxy.start(5432);
    const home = own === undefined ? world : new TestWorld(`recovery_${own}`, { REDIS_URL: redis.url });
    try {
      // (The database is created and migrated through the proxy, which is open.)
      const viaProxy = await home.start({ DATABASE_URL: `postgres://postgres@127.0.0.1:${proxy.port}/${home.dbName}`, ...env });
      try {
        await test({ proxy, viaProxy, world: home });
      } finally {
        await viaProxy.close();
      }
    } finally {
      await proxy.cut();
      if (home !== world) await home.cleanup();
    }
  }

  it('invariant 5: after FLUSHALL, every free item is reservable again within 5 s without a restart, and no allocated item ever is', async () => {
    await seedPool(api, 'wipe', numbers(20));
    const allocated: string[] = [];
    for (let i = 0; i < 5; i++) {
      const r = await api.post('/v1/pools/wipe/reservations', { owner: `buyer-${i}`, count: 1 });
      await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      allocated.push(r.body.items[0].resourceId);
    }
    await wipeRedis();

    const started = Date.now();
    const taken: string[] = [];
    await eventually(
      async () => {
        const r = await api.post('/v1/pools/wipe/reservations', { owner: 'after-wipe', count: 1 });
        if (r.status === 201) taken.push(r.body.items[0].resourceId);
        return taken.length > 0;
      },
      5000,
      50,
    );
    // Take everything that is free now: exactly the 15 unallocated items, never an allocated one.
    for (;;) {
      const r = await api.post('/v1/pools/wipe/reservations', { owner: 'after-wipe', count: 1 });
      if (r.status !== 201) {
        expect(r.body.error.code).toBe('POOL_EXHAUSTED');
        break;
      }
      taken.push(r.body.items[0].resourceId);
    }
    expect(Date.now() - started).toBeLessThan(5000);
    expect(taken).toHaveLength(15);
    expect(taken.filter((id) => allocated.includes(id))).toEqual([]);
    const rows = await world.query(`SELECT count(*)::int AS n FROM t_resource WHERE state = 2`);
    expect(rows[0].n).toBe(5);
  });

  it('a confirmed reservation stays confirmed after Redis is wiped: retries answer from Postgres', async () => {
    await seedPool(api, 'durable', numbers(3));
    const r = await api.post('/v1/pools/durable/reservations', { owner: 'payer', count: 3 });
    const body = { resourceIds: [r.body.items[0].resourceId] };
    const first = await api.post(`/v1/reservations/${r.body.id}/confirm`, body);
    await wipeRedis();
    const retry = await api.post(`/v1/reservations/${r.body.id}/confirm`, body);
    expect(retry.status).toBe(200);
    // The same answer, its keys in the same order too (the retry's comes from Postgres' jsonb, which orders them its way).
    expect(JSON.stringify(retry.body)).toBe(JSON.stringify(first.body));
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body).toMatchObject({ state: 'confirmed', allocated: first.body.allocated });
    const other = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[1].resourceId] });
    expect(other.body.error.code).toBe('RESERVATION_CLOSED');
    await eventually(async () => (await api.stats('durable')).free === 2, 5000);
  });

  /** Wipes this file's Redis (FLUSHALL). */
  async function wipeRedis(): Promise<void> {
    const client = redis.client();
    try {
      await client.flushall();
    } finally {
      client.disconnect();
    }
  }

  /** Wipes this file's Redis, and waits until the rebuild that follows has ended. */
  async function wipeRedisAndRebuild(): Promise<void> {
    await wipeRedis();
    await eventually(async () => (await api.app.get(HoldStore).rebuildState()) === 'rebuilt', 10_000);
  }

  /**
   * Creates `name` with Redis wiped inside the create, at `where` (a repository call of the create), then imports 3
   * items and reserves one at once, before any sweeper has seen the wipe; returns what those answered, and a confirm
   * of each item reserved then or, once the rebuild is done, after. Every reserve answered 201 must confirm.
   */
  async function createAcrossWipe(name: string, where: 'findByName' | 'insert') {
    const pools = api.app.get(PoolRepository);
    const real = pools[where].bind(pools) as (...args: unknown[]) => Promise<unknown>;
    const wiped = vi.spyOn(pools, where).mockImplementationOnce((async (...args: unknown[]) => {
      const result = await real(...args);
      await wipeRedis();
      return result;
    }) as never);
    try {
      expect((await api.post('/v1/pools', { name, kind: 'number' })).status).toBe(201);
      expect(wiped).toHaveBeenCalled();
    } finally {
      wiped.mockRestore();
    }
    expect((await api.post(`/v1/pools/${name}/resources`, { items: numbers(3).map((value) => ({ value })) })).status).toBe(201);
    const early = await api.post(`/v1/pools/${name}/reservations`, { owner: 'early', count: 1, ttlMs: 60_000 });
    await eventually(async () => (await api.app.get(HoldStore).rebuildState()) === 'rebuilt', 10_000);
    const { value: late } = await eventually(async () => {
      const r = await api.post(`/v1/pools/${name}/reservations`, { owner: 'late', count: 1, ttlMs: 60_000 });
      return r.status === 201 && r;
    }, 10_000);
    const confirms = [];
    for (const r of [early, late].filter((answer) => answer.status === 201)) {
      confirms.push((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status);
    }
    return { early: early.status, confirms };
  }

  it('invariant 3: a pool created while Redis is wiped takes no hold until the rebuild, and every hold it gives confirms', async () => {
    // Wiped after the insert: the create's last write of the pool's key comes after the wipe.
    const after = await createAcrossWipe('created-wiped', 'insert');
    expect(after).toEqual({ early: 409, confirms: [200] });
    // Wiped after the marker was checked, before the create's first write of the key.
    const before = await createAcrossWipe('created-wiped-early', 'findByName');
    expect(before).toEqual({ early: 409, confirms: [200] });
    expect(await api.stats('created-wiped')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
  });

  it('a pool whose creation could not finalize its Redis generation (Redis failed then) is created, and reservable once the upkeep writes it', async () => {
    const holds = api.app.get(HoldStore);
    const real = holds.setGeneration.bind(holds);
    const failed = vi.spyOn(holds, 'setGeneration').mockImplementation(async (pool, generation, mode, round) => {
      if (mode === 'finalize') throw DomainError.unavailable('redis', new Error('connection lost'));
      return real(pool, generation, mode, round);
    });
    try {
      expect((await api.post('/v1/pools', { name: 'finalized-later', kind: 'number' })).status).toBe(201);
      expect((await api.post('/v1/pools/finalized-later/resources', { items: [{ value: '1' }] })).status).toBe(201);
      // Pending: no hold yet.
      expect((await api.post('/v1/pools/finalized-later/reservations', { owner: 'o' })).body.error.code).toBe('POOL_EXHAUSTED');
    } finally {
      failed.mockRestore();
    }
    const { value } = await eventually(async () => {
      const r = await api.post('/v1/pools/finalized-later/reservations', { owner: 'o' });
      return r.status === 201 && r;
    }, 5000);
    expect((await api.post(`/v1/reservations/${value.body.id}/confirm`, { resourceIds: [value.body.items[0].resourceId] })).status).toBe(
      200,
    );
  });

  it('a pool whose insert committed but got no answer (503) is reservable within a second: the upkeep finalizes its key', async () => {
    const pools = api.app.get(PoolRepository);
    const insert = pools.insert.bind(pools);
    const lost = vi.spyOn(pools, 'insert').mockImplementationOnce(async (row) => {
      await insert(row);
      throw DomainError.unavailable('postgres', new Error('Connection terminated unexpectedly'));
    });
    try {
      expect((await api.post('/v1/pools', { name: 'answer-lost', kind: 'number' })).status).toBe(503);
    } finally {
      lost.mockRestore();
    }
    expect((await api.post('/v1/pools', { name: 'answer-lost', kind: 'number' })).body.error.code).toBe('POOL_EXISTS');
    expect((await api.post('/v1/pools/answer-lost/resources', { items: [{ value: '1' }] })).status).toBe(201);
    const started = Date.now();
    await eventually(async () => (await api.post('/v1/pools/answer-lost/reservations', { owner: 'o' })).status === 201, 5000);
    expect(Date.now() - started).toBeLessThan(2000);
  });

  it("the upkeep finalizes the generation key of a pool whose creator died before it did, with periodic rebuilds off, judging its age by Redis' clock (an instance whose clock was 60 s behind Postgres' waited 60 s more)", async () => {
    const client = redis.client();
    const key = poolKeys(world.prefix, 'creator-gone').generation;
    try {
      // As its creator left it, dead after its insert: the key pending since 40 s ago on Redis' clock (the row's
      // created_at is Postgres' now()), then this instance's clock steps to 60 s behind theirs.
      const [seconds] = await client.time();
      await client.set(key, `p${Number(seconds) * 1000 - PENDING_GENERATION_MS - 10_000}`);
      await world.query(`INSERT INTO t_pool (name, kind, hold_ttl_ms, max_hold_ttl_ms) VALUES ('creator-gone', 'number', 600000, 3600000)`);
      const wall = Date.now.bind(Date);
      vi.spyOn(Date, 'now').mockImplementation(() => wall() - 60_000);
      await api.app.get(PoolCatalog).all();
      const [{ gen }] = await world.query(`SELECT gen::text AS gen FROM t_redis_generation`);
      const started = performance.now();
      while ((await client.get(key)) !== gen && performance.now() - started < 3000) await sleep(50);
      expect(await client.get(key)).toBe(gen);
    } finally {
      vi.restoreAllMocks();
      client.disconnect();
    }
    expect((await api.post('/v1/pools/creator-gone/resources', { items: [{ value: '1' }] })).status).toBe(201);
    expect((await api.post('/v1/pools/creator-gone/reservations', { owner: 'o' })).status).toBe(201);
  });

  it('a pool found without a generation key by the upkeep, with periodic rebuilds off, gets one from a rebuild in a new generation; not while the pool is young (its creator may yet write it)', async () => {
    const [{ gen }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    const client = redis.client();
    const key = poolKeys(world.prefix, 'key-gone').generation;
    try {
      // As a wipe whose rebuild listed the pools before this one's row leaves it, its creator dead before its second
      // write (the row made here, so that this instance never saw the key final).
      await world.query(`INSERT INTO t_pool (name, kind, hold_ttl_ms, max_hold_ttl_ms) VALUES ('key-gone', 'number', 600000, 3600000)`);
      await api.app.get(PoolCatalog).all();
      // Young (by Postgres' clock): left to its creator.
      await sleep(1500);
      expect(await client.get(key)).toBeNull();
      expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen }]);
      await world.query(`UPDATE t_pool SET created_at = now() - interval '40 seconds' WHERE name = 'key-gone'`);
      await eventually(async () => (await client.get(key)) !== null, 5000);
    } finally {
      client.disconnect();
    }
    // Taken for a wipe: a new generation fences what Redis may have lost.
    expect(await world.query(`SELECT gen::int AS gen FROM t_redis_generation`)).toEqual([{ gen: gen + 1 }]);
    expect((await api.post('/v1/pools/key-gone/resources', { items: [{ value: '1' }] })).status).toBe(201);
    await eventually(async () => (await api.post('/v1/pools/key-gone/reservations', { owner: 'o' })).status === 201, 5000);
  });

  /** A rebuild in the current generation, run once no other (one the upkeep asked for, say) holds the job. */
  const rebuildNow = () => eventually(async () => (await api.app.get(RebuildService).rebuild('periodic')) !== null, 5000);

  it("a rebuild finalizes a new pool's generation key its creator left pending (it died) once the key is stale, not before", async () => {
    await seedPool(api, 'creator-died', numbers(2));
    const key = poolKeys(world.prefix, 'creator-died').generation;
    const client = redis.client();
    try {
      await client.set(key, `p${Date.now()}`);
      await rebuildNow();
      expect(await client.get(key)).toMatch(/^p\d+$/);
      expect((await api.post('/v1/pools/creator-died/reservations', { owner: 'o' })).status).toBe(409);
      await client.set(key, `p${Date.now() - PENDING_GENERATION_MS - 5000}`);
      await rebuildNow();
      const [{ gen }] = await world.query(`SELECT gen::text AS gen FROM t_redis_generation`);
      expect(await client.get(key)).toBe(gen);
    } finally {
      client.disconnect();
    }
    expect((await api.post('/v1/pools/creator-died/reservations', { owner: 'o' })).status).toBe(201);
  });

  it('a keyed reserve retried after Redis is wiped answers with its confirmed reservation (200), holding nothing more', async () => {
    await seedPool(api, 'keyed', numbers(5));
    const body = { owner: 'payer', count: 3 };
    const key = { 'Idempotency-Key': 'order-wiped-1' };
    const r = await api.post('/v1/pools/keyed/reservations', body, key);
    expect(r.status).toBe(201);
    const confirmed = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(confirmed.status).toBe(200);
    const before = await api.post('/v1/pools/keyed/reservations', body, key);
    expect(before.status).toBe(200);
    expect(before.body).toMatchObject({ id: r.body.id, state: 'confirmed' });
    const restored = async () =>
      Number(/^respool_idempotency_keys_restored_total (\d+)$/m.exec((await api.request('GET', '/metrics')).body)?.[1]);
    const restoredBefore = await restored();
    await wipeRedis();
    // Until the rebuild gives the pool its generation, a reserve there finds nothing (409) and writes no key.
    let retry = before;
    await eventually(async () => {
      retry = await api.post('/v1/pools/keyed/reservations', body, key);
      return !(retry.status === 409 && retry.body.error.code === 'POOL_EXHAUSTED');
    }, 10_000);
    expect(retry.status).toBe(200);
    expect(retry.body).toEqual(before.body);
    await eventually(async () => (await restored()) === restoredBefore + 1, 5000);
    // The reserve held nothing: the 4 items that are not allocated are all free once the rebuild has put them back.
    await eventually(async () => (await api.stats('keyed')).free === 4, 5000);
    expect((await api.stats('keyed')).held).toBe(0);
    const other = await api.post('/v1/pools/keyed/reservations', { owner: 'payer', count: 2 }, key);
    expect(other.status).toBe(409);
    expect(other.body.error.code).toBe('IDEMPOTENCY_KEY_REUSED');
    // The undo of a keyed retry that got no answer (a Redis timeout) finds no record to release or write into.
    const unanswered = makeReservationId('keyed', randomUUID());
    await api.app.get(HoldStore).undoReserve('keyed', unanswered, 'order-wiped-1');
    const peek = redis.client();
    try {
      expect(await peek.exists(poolKeys(world.prefix, 'keyed').reservation(r.body.id))).toBe(0);
    } finally {
      peek.disconnect();
    }
    expect(await api.post('/v1/pools/keyed/reservations', body, key)).toMatchObject({ status: 200, body: before.body });
  });

  it('a wipe after a rebuild put the keys back and before the pool has its generation: no reserve there until they are back again', async () => {
    await seedPool(api, 'keyed-twice', numbers(3));
    const reserve = () => api.post('/v1/pools/keyed-twice/reservations', { owner: 'payer', count: 1 }, { 'Idempotency-Key': 'twice' });
    const r = await reserve();
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(200);
    const holds = api.app.get(HoldStore);
    const restore = holds.restoreIdempotencyKeys.bind(holds);
    let rounds = 0;
    let between: Awaited<ReturnType<typeof reserve>> | undefined;
    const spy = vi.spyOn(holds, 'restoreIdempotencyKeys').mockImplementation(async (pool, keyed) => {
      if (pool !== 'keyed-twice') return restore(pool, keyed);
      rounds++;
      if (rounds === 2) between = await reserve(); // the second round, before its keys are back
      const restored = await restore(pool, keyed);
      if (rounds === 1) {
        await wipeRedis();
      }
      return restored;
    });
    onTestFinished(() => spy.mockRestore());
    await wipeRedisAndRebuild();
    expect(rounds).toBe(2);
    expect(between?.body.error?.code).toBe('POOL_EXHAUSTED');
    expect(await reserve()).toMatchObject({ status: 200, body: { id: r.body.id, state: 'confirmed' } });
  });

  it('after a wipe, only the keys of confirmed reservations come back, each until IDEMPOTENCY_TTL_MS after its reserve', async () => {
    await seedPool(api, 'keyed-ttl', numbers(10));
    const ttlMs = api.app.get(AppConfig).IDEMPOTENCY_TTL_MS;
    const reserve = (key: string) => api.post('/v1/pools/keyed-ttl/reservations', { owner: 'payer', count: 1 }, { 'Idempotency-Key': key });
    const confirm = async (r: { body: { id: string; items: { resourceId: string }[] } }) =>
      expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(200);
    const held = await reserve('held');
    const recent = await reserve('recent');
    const old = await reserve('old');
    await confirm(recent);
    await confirm(old);
    // Two confirmed reservations of one key (the key dropped in between, as a longer IDEMPOTENCY_TTL_MS than before
    // would leave): the later one's comes back.
    const twice = [await reserve('twice')];
    await confirm(twice[0]);
    const client = redis.client();
    await client.del(poolKeys(world.prefix, 'keyed-ttl').idempotency('twice'));
    twice.push(await reserve('twice'));
    await confirm(twice[1]);
    // "recent" was made a minute short of the key's lifetime ago, "old" a second past it (and confirmed then).
    const backdate = (id: string, ageMs: number, commitToo: boolean) =>
      world.query(
        `UPDATE t_commit SET body = jsonb_set(body, '{idempotency,createdMs}', to_jsonb((extract(epoch FROM now()) * 1000)::bigint - $2::bigint))
           ${commitToo ? `, created_at = now() - $2::bigint * interval '1 millisecond'` : ''}
         WHERE reservation_id = $1`,
        [id, ageMs],
      );
    await backdate(recent.body.id, ttlMs - 60_000, false);
    await backdate(old.body.id, ttlMs + 1000, true);
    await wipeRedisAndRebuild();
    const keys = poolKeys(world.prefix, 'keyed-ttl');
    try {
      expect(await client.exists(keys.idempotency('held'), keys.idempotency('old'))).toBe(0);
      const left = await client.pttl(keys.idempotency('recent'));
      expect(left).toBeGreaterThan(50_000);
      expect(left).toBeLessThanOrEqual(60_000);
    } finally {
      client.disconnect();
    }
    const again = {
      recent: await reserve('recent'),
      held: await reserve('held'),
      old: await reserve('old'),
      twice: await reserve('twice'),
    };
    expect(again.twice).toMatchObject({ status: 200, body: { id: twice[1].body.id } });
    expect(again.recent.status).toBe(200);
    expect(again.recent.body).toMatchObject({ id: recent.body.id, state: 'confirmed' });
    // The held reservation's holds went with the wipe: its retry makes a new one, as does the one whose key has lapsed.
    expect(again.held.status).toBe(201);
    expect(again.held.body.id).not.toBe(held.body.id);
    expect(again.old.status).toBe(201);
    expect(again.old.body.id).not.toBe(old.body.id);
  });

  it('an Idempotency-Key naming a reservation neither Redis nor Postgres has is taken by a new reservation', async () => {
    await seedPool(api, 'keyed-ghost', numbers(3));
    const reserve = () => api.post('/v1/pools/keyed-ghost/reservations', { owner: 'payer', count: 1 }, { 'Idempotency-Key': 'ghost' });
    const first = await reserve();
    expect(first.status).toBe(201);
    // The key now names a reservation that never was (as a key whose record was lost would), with the same body.
    const idem = poolKeys(world.prefix, 'keyed-ghost').idempotency('ghost');
    const ghost = 'keyed-ghost.00000000-0000-4000-8000-000000000000';
    const client = redis.client();
    try {
      const [, hash] = (await client.get(idem))!.split('\n');
      await client.set(idem, `${ghost}\n${hash}`, 'KEEPTTL');
    } finally {
      client.disconnect();
    }
    const taken = await reserve();
    expect(taken.status).toBe(201);
    expect([first.body.id, ghost]).not.toContain(taken.body.id);
    const replay = await reserve();
    expect(replay.status).toBe(200);
    expect(replay.body.id).toBe(taken.body.id);
  });

  it('invariant 5: a confirm pinned before Redis was wiped cannot land on an item the rebuild handed out again', async () => {
    await seedPool(api, 'wiped-mid-commit', numbers(1));
    const r = await api.post('/v1/pools/wiped-mid-commit/reservations', { owner: 'slow', count: 1 });
    const id = r.body.items[0].resourceId;
    // The confirm pins its hold, then stalls before Postgres; meanwhile Redis is wiped and rebuilt.
    const slow = await stalledConfirm(api, 'wiped-mid-commit', r.body.id, id, 15_000);
    await wipeRedis();
    const rival = await reserveWhenFree(api, 'wiped-mid-commit', 'rival');
    // The stalled commit arrives with a valid version, but from the old Redis generation: refused.
    const late = await slow.land();
    expect(late).toBe('conflict');
    const won = await api.post(`/v1/reservations/${rival.body.id}/confirm`, { resourceIds: [id] });
    expect(won.status).toBe(200);
    expect(await world.query(`SELECT owner FROM t_resource WHERE id = $1`, [id])).toEqual([{ owner: 'rival' }]);
  });

  it('invariant 5: a free-index write that read Postgres before a wipe cannot put back an item allocated since', async () => {
    await seedPool(api, 'stale-page', numbers(2));
    const holds = api.app.get(HoldStore);
    const before = await api.app.get(GenerationRepository).current();
    const r = await api.post('/v1/pools/stale-page/reservations', { owner: 'buyer', count: 1 });
    const [held] = r.body.items;
    // What a rebuild page, an import or a release read just before the allocation: the item, free.
    const stale = { id: held.resourceId, v: held.value, n: held.version, g: null, a: {} };
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [held.resourceId] })).status).toBe(200);
    await wipeRedis();
    await eventually(async () => (await api.stats('stale-page'))?.free === 1, 5000);
    // The late write arrives after the rebuild: its allocation tombstone was wiped, the generation fences it.
    expect(await holds.addFree('stale-page', before, await holds.clock(), [stale])).toBe(0);
    const taken = await api.post('/v1/pools/stale-page/reservations', { owner: 'after', count: 2 });
    expect(taken.body.error.code).toBe('POOL_EXHAUSTED');
    const one = await api.post('/v1/pools/stale-page/reservations', { owner: 'after', count: 1 });
    expect(one.body.items[0].resourceId).not.toBe(held.resourceId);
    // Before the rebuild (no generation key yet) nothing is added either: the rebuild reads Postgres again.
    const gen = poolKeys(api.config.REDIS_KEY_PREFIX, 'stale-page').generation;
    const admin = redis.client();
    const current = await admin.get(gen);
    await admin.del(gen);
    try {
      expect(await holds.addFree('stale-page', Number(current), await holds.clock(), [stale])).toBe(0);
      expect(await holds.holder('stale-page', held.resourceId)).toBeNull();
    } finally {
      await admin.set(gen, current!);
      admin.disconnect();
    }
    expect((await api.post('/v1/pools/stale-page/reservations', { owner: 'after', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');
  });

  it('invariant 6: a Redis command answered 503 is not run later, when the connection comes back', async () => {
    const proxy = await TcpProxy.start(redis.port);
    const viaProxy = await world.start({
      REDIS_URL: `redis://127.0.0.1:${proxy.port}`,
      REDIS_TIMEOUT_MS: '300',
      SWEEP_INTERVAL_MS: '10000',
    });
    try {
      await seedPool(viaProxy, 'ghost', numbers(3));
      // The reserve reaches the proxy but not Redis before its timeout; then the connection drops.
      proxy.latencyMs = 2000;
      const reserve = await viaProxy.post('/v1/pools/ghost/reservations', { owner: 'told-503', count: 3 });
      expect(reserve.status).toBe(503);
      expect(reserve.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
      await proxy.cut();
      proxy.latencyMs = 0;
      await proxy.open();
      await eventually(async () => (await viaProxy.get('/v1/pools/ghost')).status === 200, 5000);
      await sleep(300);
      // Re-sent on the new connection, it would hold all three for a caller that was told nothing happened.
      expect((await viaProxy.get('/v1/pools/ghost')).body.stats).toMatchObject({ free: 3, held: 0 });
      expect((await viaProxy.post('/v1/pools/ghost/reservations', { owner: 'next', count: 3 })).status).toBe(201);
    } finally {
      await viaProxy.close();
      world.instances.splice(world.instances.indexOf(viaProxy), 1);
      await proxy.cut();
    }
  });

  it('invariant 6: with Redis down, reserve, confirm and the task calls answer 503 DEPENDENCY_UNAVAILABLE and change nothing', async () => {
    await seedPool(api, 'redis-down', numbers(3));
    const r = await api.post('/v1/pools/redis-down/reservations', { owner: 'payer', count: 2 });
    await seedPool(api, 'redis-down-tasks', ['task-1', 'task-2'], { kind: 'task' });
    const lease = await api.post('/v1/pools/redis-down-tasks/tasks/next', { reviewer: 'r-1' });
    expect(lease.status).toBe(200);
    const warned = vi.spyOn(Logger.prototype, 'warn');
    await redis.stop();
    try {
      for (const [path, body] of [
        ['/v1/pools/redis-down-tasks/tasks/next', { reviewer: 'r-2' }],
        [`/v1/tasks/${lease.body.leaseId}/heartbeat`, { leaseMs: 60_000 }],
        [`/v1/tasks/${lease.body.leaseId}/complete`, {}],
        [`/v1/tasks/${lease.body.leaseId}/abandon`, {}],
      ] as const) {
        const answer = await api.post(path, body);
        expect([answer.status, answer.body.error?.code], path).toEqual([503, 'DEPENDENCY_UNAVAILABLE']);
      }
      expect(
        await world.query(
          `SELECT count(*)::int AS n FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'redis-down-tasks' AND r.state = 2`,
        ),
      ).toEqual([{ n: 0 }]);
      const reserve = await api.post('/v1/pools/redis-down/reservations', { owner: 'x', count: 1 });
      expect(reserve.status).toBe(503);
      expect(reserve.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
      const confirm = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      expect(confirm.status).toBe(503);
      const imported = await api.post('/v1/pools/redis-down/resources', { items: [{ value: 'new-one' }] });
      expect(imported.status).toBe(503);
      const created = await api.post('/v1/pools', { name: 'born-while-down', kind: 'number' });
      expect(created.status).toBe(503);
      expect(await world.query(`SELECT name FROM t_pool WHERE name = 'born-while-down'`)).toEqual([]);
      const ready = await api.get('/health/ready');
      expect([ready.status, ready.body.error.message]).toEqual([503, 'unavailable: redis']);
      // Ten answers 503 for Redis, one line in the log (a line each flooded it during an outage).
      // (The readiness probe's is another kind, logged apart: it does not hide the driver's error.)
      const lines = warned.mock.calls
        .map(([line]) => line as { dependency?: unknown; msg?: string } | null)
        .filter((line) => line?.dependency === 'redis');
      expect(lines.filter((line) => line?.msg?.startsWith('redis is unavailable; nothing was changed: '))).toHaveLength(1);
      expect(lines.map((line) => line?.msg?.split(':')[0]).sort()).toEqual(['redis is unavailable; nothing was changed', 'unavailable']);
      // The readiness line says what the failed check said.
      expect(lines.some((line) => /^unavailable: redis: redis: \S/.test(line?.msg ?? ''))).toBe(true);
      const rows = await world.query(
        `SELECT count(*)::int AS n, count(*) FILTER (WHERE state = 2)::int AS allocated FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'redis-down'`,
      );
      expect(rows[0]).toEqual({ n: 3, allocated: 0 });
    } finally {
      warned.mockRestore();
      await redis.start();
    }
    // Back up (empty, like a restart without persistence): rebuilt from Postgres by itself.
    await eventually(async () => (await api.get('/health/ready')).status === 200, 5000);
    await eventually(async () => (await api.stats('redis-down'))?.free === 3, 5000);
  });

  it('invariant 6: with Postgres unreachable, confirm answers 503 and allocates nothing; it succeeds once Postgres is back', async () => {
    await behindPostgresProxy({ DB_TIMEOUT_MS: '1000' }, undefined, async ({ proxy, viaProxy }) => {
      await seedPool(viaProxy, 'pg-down', numbers(3));
      const r = await viaProxy.post('/v1/pools/pg-down/reservations', { owner: 'payer', count: 2 });
      const body = { resourceIds: [r.body.items[0].resourceId] };
      await proxy.cut();
      const started = Date.now();
      const confirm = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, body);
      expect(confirm.status).toBe(503);
      expect(confirm.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
      expect(Date.now() - started).toBeLessThan(5000);
      const created = await viaProxy.post('/v1/pools', { name: 'while-down', kind: 'number' });
      expect(created.status).toBe(503);
      const rows = await world.query(`SELECT count(*)::int AS n FROM t_resource WHERE state = 2 AND id = $1`, [body.resourceIds[0]]);
      expect(rows[0].n).toBe(0);
      // The failed confirm changed nothing: the reservation is still held, so the retry below can succeed.
      expect((await viaProxy.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
      // Expiry needs no Postgres: a short hold taken now comes back to the pool while Postgres is away.
      const short = await viaProxy.post('/v1/pools/pg-down/reservations', { owner: 'brief', count: 1, ttlMs: 1000 });
      expect(short.status).toBe(201);
      await eventually(
        async () => (await viaProxy.post('/v1/pools/pg-down/reservations', { owner: 'next', count: 1, ttlMs: 1000 })).status === 201,
        3000,
      );
      await proxy.open();
      const retry = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, body);
      expect(retry.status).toBe(200);
    });
  });

  it("invariant 6: with Postgres unreachable, a task complete answers 503 and allocates nothing; the lease stays its reviewer's, and completes once Postgres is back", async () => {
    await behindPostgresProxy({ DB_TIMEOUT_MS: '1000' }, undefined, async ({ proxy, viaProxy }) => {
      await seedPool(viaProxy, 'pg-down-tasks', ['task-1'], { kind: 'task' });
      const lease = await viaProxy.post('/v1/pools/pg-down-tasks/tasks/next', { reviewer: 'r-1', leaseMs: 60_000 });
      expect(lease.status).toBe(200);
      await proxy.cut();
      const complete = await viaProxy.post(`/v1/tasks/${lease.body.leaseId}/complete`, {});
      expect([complete.status, complete.body.error?.code]).toEqual([503, 'DEPENDENCY_UNAVAILABLE']);
      expect(await world.query(`SELECT state FROM t_resource WHERE id = $1`, [lease.body.resourceId])).toEqual([{ state: 1 }]);
      // Nothing changed: the task is still leased to r-1 (another reviewer gets none, r-1's heartbeat succeeds).
      expect((await viaProxy.post('/v1/pools/pg-down-tasks/tasks/next', { reviewer: 'r-2' })).status).toBe(204);
      expect((await viaProxy.post(`/v1/tasks/${lease.body.leaseId}/heartbeat`, { leaseMs: 60_000 })).status).toBe(200);
      await proxy.open();
      const retry = await viaProxy.post(`/v1/tasks/${lease.body.leaseId}/complete`, {});
      expect([retry.status, retry.body.state]).toEqual([200, 'completed']);
      expect(await world.query(`SELECT state, owner FROM t_resource WHERE id = $1`, [lease.body.resourceId])).toEqual([
        { state: 2, owner: 'r-1' },
      ]);
    });
  });

  it('invariant 6: a confirm answered 503 while Postgres is unreachable changes nothing: not retried, all the items come back at expiry', async () => {
    await behindPostgresProxy({ DB_TIMEOUT_MS: '1000', RECONCILE_INTERVAL_MS: '0' }, 'unsent', async ({ proxy, viaProxy, world }) => {
      await seedPool(viaProxy, 'unsent', numbers(3));
      const r = await viaProxy.post('/v1/pools/unsent/reservations', { owner: 'payer', count: 3, ttlMs: 3000 });
      expect(r.status).toBe(201);
      await proxy.cut();
      const confirm = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      expect(confirm.status).toBe(503);
      expect(confirm.body.error.details.outcome).toBeUndefined();
      expect((await viaProxy.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
      // The payer gives up. Without the confirm every item would be free again soon after expiresAt, Postgres or not:
      // so it must be with it (the commit never reached Postgres, so there is nothing to wait for).
      await sleep(Date.parse(r.body.expiresAt) - Date.now());
      const { value: next } = await eventually(async () => {
        const all = await viaProxy.post('/v1/pools/unsent/reservations', { owner: 'next', count: 3 });
        return all.status === 201 && all;
      }, 2000);
      expect((await viaProxy.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('expired');
      await proxy.open();
      expect((await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(
        409,
      );
      const confirmed = await viaProxy.post(`/v1/reservations/${next.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      expect(confirmed.status).toBe(200);
      const allocated = await world.query(
        `SELECT r.owner FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'unsent' AND r.state = 2`,
      );
      expect(allocated).toEqual([{ owner: 'next' }]);
    });
  });

  it('invariant 6: after a confirm answered 503 with Postgres unreachable, a retry commits even if Postgres ended the epoch meanwhile', async () => {
    await behindPostgresProxy({ DB_TIMEOUT_MS: '1000', RECONCILE_INTERVAL_MS: '0' }, 'retried', async ({ proxy, viaProxy, world }) => {
      await seedPool(viaProxy, 'retried', numbers(2));
      const r = await viaProxy.post('/v1/pools/retried/reservations', { owner: 'payer', count: 2, ttlMs: 60_000 });
      const body = { resourceIds: [r.body.items[1].resourceId] };
      await proxy.cut();
      expect((await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, body)).status).toBe(503);
      await proxy.open();
      // The failed attempt's epoch (1) was given back with everything else. Should its request to end that epoch have
      // reached Postgres after all (a timeout), Postgres has it ended: the retry's commit in epoch 1 is refused, and
      // it must go on in a new epoch.
      await world.query(`INSERT INTO t_commit_decision (reservation_id, epoch, decision) VALUES ($1, 1, 'abort')`, [r.body.id]);
      const retry = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, body);
      expect(retry.status).toBe(200);
      expect(retry.body.allocated.map((a: { resourceId: string }) => a.resourceId)).toEqual(body.resourceIds);
      const decisions = await world.query(`SELECT epoch, decision FROM t_commit_decision WHERE reservation_id = $1 ORDER BY epoch`, [
        r.body.id,
      ]);
      expect(decisions).toEqual([
        { epoch: 1, decision: 'abort' },
        { epoch: 2, decision: 'commit' },
      ]);
    });
  });

  it('invariant 6: a late confirm answered 503 while Postgres is unreachable leaves the items its expired hold had in the pool', async () => {
    await behindPostgresProxy({ DB_TIMEOUT_MS: '1000', RECONCILE_INTERVAL_MS: '0' }, 'late', async ({ proxy, viaProxy, world }) => {
      await seedPool(viaProxy, 'late-503', numbers(1));
      const r = await viaProxy.post('/v1/pools/late-503/reservations', { owner: 'buyer', count: 1, ttlMs: 1000 });
      expect(r.status).toBe(201);
      const item = r.body.items[0].resourceId as string;
      // The hold runs out and the sweeper puts the item back; then the payment callback comes, while Postgres is out.
      await eventually(async () => (await viaProxy.get(`/v1/pools/late-503/resources/${item}`)).body.state === 'free', 5000);
      expect((await viaProxy.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('expired');
      await proxy.cut();
      const confirm = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [item] });
      expect(confirm.status).toBe(503);
      expect(confirm.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
      expect(confirm.body.error.message).toContain('nothing was changed');
      // Nothing was changed: the item is as free as before, for the next caller (Redis alone serves a reserve).
      const next = await viaProxy.post('/v1/pools/late-503/reservations', { owner: 'next', count: 1 });
      expect(next.status).toBe(201);
      expect(next.body.items[0].resourceId).toBe(item);
      // Once Postgres is back, the late confirm finds the item taken, and the next caller's confirm succeeds.
      await proxy.open();
      const again = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [item] });
      expect(again.status).toBe(409);
      expect((await viaProxy.post(`/v1/reservations/${next.body.id}/confirm`, { resourceIds: [item] })).status).toBe(200);
      const rows = await world.query(`SELECT owner, state FROM t_resource WHERE id = $1`, [item]);
      expect(rows).toEqual([{ owner: 'next', state: 2 }]);
    });
  });

  it('invariant 4: a commit left undecided by a Postgres outage is settled at the first upkeep after Postgres is back', async () => {
    await behindPostgresProxy(
      { DB_TIMEOUT_MS: '1000', COMMIT_WINDOW_MS: '12000', RECONCILE_INTERVAL_MS: '0' },
      'stalled',
      async ({ proxy, viaProxy, world }) => {
        await seedPool(viaProxy, 'stalled', numbers(1));
        const r = await viaProxy.post('/v1/pools/stalled/reservations', { owner: 'buyer', count: 1, ttlMs: 1000 });
        const item = r.body.items[0].resourceId as string;
        await eventually(async () => (await viaProxy.get(`/v1/pools/stalled/resources/${item}`)).body.state === 'free', 5000);
        // Postgres hangs: the late confirm's commit times out, and may have landed, so its item stays pinned until
        // Postgres has said whether it did.
        proxy.latencyMs = 60_000;
        const pinnedAt = Date.now();
        const confirm = await viaProxy.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [item] });
        expect(confirm.status).toBe(503);
        // The commit window ends while Postgres still hangs: the sweeper's attempt to settle it then fails (every
        // Postgres call of its upkeep waits for DB_TIMEOUT_MS, so that attempt may come a few seconds late).
        await sleep(pinnedAt + 17_000 - Date.now());
        expect((await viaProxy.post('/v1/pools/stalled/reservations', { owner: 'next', count: 1 })).status).toBe(409);
        await proxy.cut();
        proxy.latencyMs = 0;
        await proxy.open();
        // Settled at the next upkeep, not a whole commit window (12 s) after the failed attempt, when the sweep would
        // report it again.
        await eventually(
          async () => (await viaProxy.post('/v1/pools/stalled/reservations', { owner: 'next', count: 1 })).status === 201,
          5000,
        );
        const rows = await world.query(`SELECT state FROM t_resource WHERE id = $1`, [item]);
        expect(rows).toEqual([{ state: 1 }]);
      },
    );
  }, 40_000);

  it('invariant 4: while Postgres hangs (answers nothing), expired holds still come back within 2 s', async () => {
    await behindPostgresProxy({ SWEEP_INTERVAL_MS: '250', RECONCILE_INTERVAL_MS: '0' }, 'hung', async ({ proxy, viaProxy }) => {
      await seedPool(viaProxy, 'pg-hung', numbers(1));
      // Every Postgres call of the instance now waits for its timeout (DB_TIMEOUT_MS, 5 s): the pool list's
      // refresh every 2 s, and any commit to settle. The sweep must not wait for them.
      proxy.latencyMs = 8000;
      await sleep(2500);
      let latest = 0;
      for (let round = 0; round < 3; round++) {
        const r = await viaProxy.post('/v1/pools/pg-hung/reservations', { owner: 'brief', count: 1, ttlMs: 1000 });
        expect(r.status).toBe(201);
        const { value: again } = await eventually(async () => {
          const next = await viaProxy.post('/v1/pools/pg-hung/reservations', { owner: 'next', count: 1, ttlMs: 1000 });
          return next.status === 201 && next;
        }, 8000);
        latest = Math.max(latest, Date.now() - Date.parse(r.body.expiresAt));
        expect((await viaProxy.del(`/v1/reservations/${again.body.id}`)).status).toBe(200);
      }
      expect(latest).toBeLessThan(2000);
    });
  });

  it('invariant 4: while Postgres is unreachable, the items a stalled confirm did not choose come back at their expiry', async () => {
    await behindPostgresProxy(
      { DB_TIMEOUT_MS: '1000', COMMIT_WINDOW_MS: '20000', RECONCILE_INTERVAL_MS: '0' },
      'unchosen',
      async ({ proxy, viaProxy }) => {
        await seedPool(viaProxy, 'unchosen', numbers(2));
        const r = await viaProxy.post('/v1/pools/unchosen/reservations', { owner: 'buyer', count: 2, ttlMs: 4000 });
        const [chosen, other] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
        // A confirm pins one item for 2 s, and its instance dies before Postgres; then Postgres becomes unreachable.
        // When the pin's window ends, the sweeper cannot learn the commit's outcome, and looks again a recheck
        // (COMMIT_WINDOW_MS, 20 s) later; the item not chosen must not wait for that.
        await stalledConfirm(viaProxy, 'unchosen', r.body.id, chosen, 2000);
        await proxy.cut();
        const { value } = await eventually(
          async () => {
            const next = await viaProxy.post('/v1/pools/unchosen/reservations', { owner: 'next', count: 1 });
            return next.status === 201 && next;
          },
          12_000,
          100,
        );
        expect(Date.now() - Date.parse(r.body.expiresAt)).toBeLessThan(2000);
        expect(value.body.items.map((i: { resourceId: string }) => i.resourceId)).toEqual([other]);
        await proxy.open();
      },
    );
  }, 30_000);

  it('invariant 4: holds of an instance that is gone come back to the pool after their expiry', async () => {
    const doomed = await world.start();
    await seedPool(doomed, 'crash', numbers(2));
    const r = await doomed.post('/v1/pools/crash/reservations', { owner: 'victim', count: 2, ttlMs: 1000 });
    expect(r.status).toBe(201);
    await doomed.close();
    const { value } = await eventually(async () => {
      const again = await api.post('/v1/pools/crash/reservations', { owner: 'survivor', count: 2 });
      return again.status === 201 ? again : null;
    }, 4000);
    expect(Date.now() - Date.parse(r.body.expiresAt)).toBeLessThan(2000);
    expect(value.body.items).toHaveLength(2);
  });

  it('refuses to start when Postgres or Redis cannot be reached, saying which and where (never the password)', async () => {
    const closed = await freePort();
    const noPostgres = refusedStart(
      world.config({ DATABASE_URL: `postgres://postgres:S3cret@127.0.0.1:${closed}/x`, DB_TIMEOUT_MS: '1000' }),
    );
    await expect(noPostgres).rejects.toBeInstanceOf(StartupError);
    await expect(noPostgres).rejects.toThrow(new RegExp(`^Postgres at 127\\.0\\.0\\.1:${closed} cannot be reached: `));
    await expect(noPostgres).rejects.not.toThrow(/S3cret/);
    const noRedis = refusedStart(world.config({ REDIS_URL: `redis://:S3cret@127.0.0.1:${closed}`, REDIS_TIMEOUT_MS: '500' }));
    await expect(noRedis).rejects.toBeInstanceOf(StartupError);
    // The socket's own error, not ioredis' "Connection is closed.".
    await expect(noRedis).rejects.toThrow(new RegExp(`^Redis at 127\\.0\\.0\\.1:${closed} cannot be reached: connect ECONNREFUSED`));
    await expect(noRedis).rejects.not.toThrow(/S3cret/);
  });

  it('says a dependency refused the connection when it answered: a role that may not log in, a wrong Redis password', async () => {
    const role = `respool_nologin_${process.pid}`;
    await world.query(`CREATE ROLE ${role} NOLOGIN`);
    try {
      const url = new URL(world.config().DATABASE_URL);
      url.username = role;
      await expect(refusedStart(world.config({ DATABASE_URL: url.toString() }))).rejects.toThrow(
        new RegExp(`^Postgres at 127\\.0\\.0\\.1:${url.port || 5432} refused the connection: role "${role}" is not permitted to log in`),
      );
    } finally {
      await world.query(`DROP ROLE ${role}`);
    }
    const locked = await OwnRedis.start();
    try {
      const admin = locked.client();
      await admin.config('SET', 'requirepass', 'right');
      admin.disconnect();
      const wrong = new URL(locked.url);
      wrong.password = 'wrong';
      await expect(refusedStart(world.config({ REDIS_URL: wrong.toString() }))).rejects.toThrow(
        new RegExp(`^Redis at 127\\.0\\.0\\.1:${locked.port} refused the connection: WRONGPASS`),
      );
    } finally {
      await locked.stop();
    }
  });

  it('says in one line what Postgres or Redis refused at start-up: creating the database, a migration, a Redis database number, INFO', async () => {
    const role = `respool_limited_${process.pid}`;
    const existing = `${world.config().DATABASE_URL.split('/').pop()}_limited`;
    try {
      await world.query(`CREATE ROLE ${role} LOGIN NOCREATEDB`);
      await world.query(`CREATE DATABASE ${existing}`);
      const as = (database: string) => {
        const url = new URL(world.config().DATABASE_URL);
        url.username = role;
        url.pathname = `/${database}`;
        return url.toString();
      };
      const where = `Postgres at 127\\.0\\.0\\.1:${new URL(world.config().DATABASE_URL).port || 5432}`;
      // Its database is missing, and it may not create one.
      await expect(refusedStart(world.config({ DATABASE_URL: as(`${existing}_missing`) }))).rejects.toThrow(
        new RegExp(`^${where} refused to create database "${existing}_missing": permission denied to create database \\(create it,`),
      );
      // Its database exists, and it may not create tables in it (Postgres 15: no CREATE on schema public).
      await expect(refusedStart(world.config({ DATABASE_URL: as(existing) }))).rejects.toThrow(
        new RegExp(`^${where} refused a migration: permission denied for schema public$`),
      );
    } finally {
      try {
        await world.query(`DROP DATABASE IF EXISTS ${existing} WITH (FORCE)`);
      } finally {
        await world.query(`DROP ROLE IF EXISTS ${role}`);
      }
    }
    const own = await OwnRedis.start();
    try {
      const admin = own.client();
      await admin.call('ACL', 'SETUSER', 'noinfo', 'on', '>pw', '~*', '+@all', '-info');
      admin.disconnect();
      const at = `Redis at 127\\.0\\.0\\.1:${own.port}`;
      // ioredis only warns when its SELECT fails, and would go on in database 0.
      await expect(refusedStart(world.config({ REDIS_URL: `${own.url}/99` }))).rejects.toThrow(
        new RegExp(`^${at} refused database 99: ERR DB index is out of range`),
      );
      await expect(refusedStart(world.config({ REDIS_URL: `redis://noinfo:pw@127.0.0.1:${own.port}` }))).rejects.toThrow(
        new RegExp(`^${at} refused INFO: NOPERM`),
      );
    } finally {
      await own.stop();
    }
  });

  it('is not ready (503) while its Redis may evict keys, and ready again once it may not', async () => {
    const client = redis.client();
    try {
      await client.config('SET', 'maxmemory-policy', 'allkeys-lru');
      const refused = await api.get('/health/ready');
      expect(refused.status).toBe(503);
      expect(refused.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
      expect(JSON.stringify(refused.body.error.details.report)).toMatch(
        /maxmemory-policy \\"allkeys-lru\\"; respool needs \\"noeviction\\"/,
      );
    } finally {
      await client.config('SET', 'maxmemory-policy', 'noeviction');
      client.disconnect();
    }
    expect((await api.get('/health/ready')).status).toBe(200);
  });

  it('refuses to start when Redis may evict keys', async () => {
    const evicting = await OwnRedis.start(['--maxmemory-policy', 'allkeys-lru']);
    try {
      const where = new URL(evicting.url);
      await expect(refusedStart(world.config({ REDIS_URL: evicting.url }))).rejects.toThrow(
        `Redis at ${where.hostname}:${where.port} has maxmemory-policy "allkeys-lru"; respool needs "noeviction"`,
      );
    } finally {
      await evicting.stop();
    }
    await sleep(10);
  });
});
