import { mkdtempSync, rmSync } from 'node:fs';
import pg from 'pg';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { checkpointKey, poolKeys } from '../../src/redis/keys.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { TestInstance, TestWorld, eventually, numbers, quietSweepers, seedPool, sleep, untilRebuilt } from '../support/harness.js';
import { OwnRedis, databaseUrl } from '../support/services.js';

// Invariants 3 and 5 when Redis goes back in time: restored from an older snapshot (or failed over to a replica that
// lagged), it keeps its rebuilt-marker, so no wipe is seen. This file runs its own redis-server, which writes its
// snapshot into a directory of the file's own and loads it again when it restarts.
describe('Redis restored from an older snapshot', () => {
  const dir = mkdtempSync(join(tmpdir(), 'respool-rollback-'));
  const serverArgs = ['--dir', dir, '--dbfilename', 'snapshot.rdb'];
  let redis: OwnRedis;
  let world: TestWorld;

  beforeAll(async () => {
    redis = await OwnRedis.start(serverArgs);
    world = new TestWorld('rollback', { REDIS_URL: redis.url });
  });
  afterAll(async () => {
    try {
      await world.cleanup();
    } finally {
      await redis.stop();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  async function withRedis<T>(use: (client: ReturnType<OwnRedis['client']>) => Promise<T>): Promise<T> {
    const client = redis.client();
    try {
      return await use(client);
    } finally {
      client.disconnect();
    }
  }

  const postgresCheckpoint = async () => Number((await world.query(`SELECT n FROM t_redis_checkpoint`))[0].n);
  const redisCheckpoint = async () => {
    const n = await withRedis((client) => client.get(checkpointKey(world.prefix)));
    return n === null ? null : Number(n);
  };

  /** Postgres' checkpoint as if last raised long ago: the next check may take a step at once. */
  const ageCheckpoint = () => world.query(`UPDATE t_redis_checkpoint SET raised_at = now() - interval '1 minute'`);
  /** A check that may take a step. */
  async function step(rebuilder: RebuildService): Promise<boolean> {
    await ageCheckpoint();
    return rebuilder.checkpoint();
  }

  /** Redis' checkpoint set two behind Postgres', as a Redis that went back in time would have it. */
  async function makeBehind(): Promise<void> {
    const postgres = await postgresCheckpoint();
    await withRedis((client) => client.set(checkpointKey(world.prefix), String(postgres - 2)));
  }

  /** Has Redis close the instance's connection, and waits until ioredis has opened it again. */
  async function newConnection(instance: TestInstance): Promise<void> {
    await withRedis((client) => client.client('KILL', 'TYPE', 'normal', 'SKIPME', 'yes'));
    // A command that waits for no check tells when it is back.
    const back = () =>
      instance.app
        .get(HoldStore)
        .clock()
        .then(
          () => true,
          () => false,
        );
    await eventually(back, 5000);
  }

  /** An instance on this file's Redis whose sweeper leaves the checkpoint and the rebuild alone, once Redis is rebuilt. */
  async function quietInstance(): Promise<TestInstance> {
    const instance = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    onTestFinished(() => instance.close());
    await untilRebuilt(instance);
    quietSweepers(instance);
    return instance;
  }

  /**
   * An instance with a pool of `values`, on a rebuilt Redis whose checkpoint it has read, whose sweeper leaves the
   * checkpoint alone: only the check of a new connection can find Redis behind.
   */
  async function gatedInstance(pool: string, values: string[]): Promise<{ api: TestInstance; rebuilder: RebuildService }> {
    const api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    onTestFinished(() => api.close());
    await seedPool(api, pool, values);
    quietSweepers(api);
    const rebuilder = api.app.get(RebuildService);
    await untilRebuilt(api);
    await rebuilder.checkpoint();
    return { api, rebuilder };
  }

  it("invariants 3 and 5: the snapshot is found behind, dropped and rebuilt; no allocated item is handed out, and a confirmed reservation's Idempotency-Key still answers with it", async () => {
    const api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    onTestFinished(() => api.close());
    await seedPool(api, 'snap', numbers(10));
    // Keys the drop must leave alone: another deployment's, whose prefix starts with this one's. (An older key layout's
    // marker would make this version rebuild as after a wipe: rebuild.test.ts.)
    const others = [`${world.prefix}other:{snap}:free`, `${world.prefix}other:meta:rebuilt:2`];
    await withRedis(async (client) => {
      for (const key of others) await client.set(key, 'not respool');
    });
    const early = await api.post('/v1/pools/snap/reservations', { owner: 'early', count: 2 }, { 'Idempotency-Key': 'order-1' });
    expect(early.status).toBe(201);
    const snapshotAt = (await eventually(redisCheckpoint, 5000)).value;
    await withRedis((client) => client.save());

    // After the snapshot: the early reservation is confirmed, and a later one is made and confirmed, of items free
    // in the snapshot.
    const kept = early.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${early.body.id}/confirm`, { resourceIds: [kept] })).status).toBe(200);
    const lateBody = { owner: 'late', count: 3 };
    const late = await api.post('/v1/pools/snap/reservations', lateBody, { 'Idempotency-Key': 'order-2' });
    expect(late.status).toBe(201);
    const taken = late.body.items[0].resourceId;
    const confirmed = await api.post(`/v1/reservations/${late.body.id}/confirm`, { resourceIds: [taken] });
    expect(confirmed.status).toBe(200);
    // The checkpoint moves on until the snapshot's is at least two behind Postgres' (a step may have come between the
    // read above and the save).
    await eventually(async () => (await postgresCheckpoint()) >= snapshotAt + 3, 10_000);

    await redis.stop();
    await redis.start(serverArgs);
    expect(await withRedis((client) => client.exists(poolKeys(world.prefix, 'snap').reservation(late.body.id)))).toBe(0);

    // Found within about a second, dropped and rebuilt: the checkpoint is back in line with Postgres'.
    await eventually(async () => {
      const n = await redisCheckpoint();
      return n !== null && n >= (await postgresCheckpoint()) - 1 && (await api.app.get(HoldStore).rebuildState()) === 'rebuilt';
    }, 10_000);
    const metrics = await api.get('/metrics');
    expect(metrics.body).toMatch(/respool_rebuilds_total\{reason="rolledBack"\} 1\b/);

    // Every free item, and only those, can be reserved; neither allocated one (the snapshot had the later one free).
    const allocated = (await world.query<{ id: string }>(`SELECT id::text FROM t_resource WHERE state = 2`)).map((row) => row.id);
    expect(allocated.sort()).toEqual([kept, taken].sort());
    const handedOut: string[] = [];
    for (let i = 0; i < 8; i++) {
      const r = await api.post('/v1/pools/snap/reservations', { owner: `after-${i}`, count: 1 });
      expect(r.status).toBe(201);
      handedOut.push(r.body.items[0].resourceId);
    }
    expect(handedOut.filter((id) => allocated.includes(id))).toEqual([]);
    expect((await api.post('/v1/pools/snap/reservations', { owner: 'one-too-many', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');

    // The later reservation's key, which the snapshot never had, answers with it, as does the earlier one's.
    const retry = await api.post('/v1/pools/snap/reservations', lateBody, { 'Idempotency-Key': 'order-2' });
    expect(retry.status).toBe(200);
    expect(retry.body).toMatchObject({ id: late.body.id, state: 'confirmed' });
    const earlyRetry = await api.post('/v1/pools/snap/reservations', { owner: 'early', count: 2 }, { 'Idempotency-Key': 'order-1' });
    expect(earlyRetry.status).toBe(200);
    expect(earlyRetry.body).toMatchObject({ id: early.body.id, state: 'confirmed' });
    expect(await withRedis((client) => Promise.all(others.map((key) => client.get(key))))).toEqual(['not respool', 'not respool']);
  });

  it('the first reserves on a new connection to a Redis gone back in time are answered 503 until it is rebuilt: none takes an allocated item or makes a second reservation for a lost key', async () => {
    // Only the check on a new connection may find it: the sweeper's is off.
    const { api, rebuilder } = await gatedInstance('gate', numbers(3, '1370000'));
    await withRedis((client) => client.save());
    const body = { owner: 'buyer', count: 1 };
    const made = await api.post('/v1/pools/gate/reservations', body, { 'Idempotency-Key': 'order-3' });
    expect(made.status).toBe(201);
    expect((await api.post(`/v1/reservations/${made.body.id}/confirm`, { resourceIds: [made.body.items[0].resourceId] })).status).toBe(200);
    for (let i = 0; i < 3; i++) await step(rebuilder);

    await redis.stop();
    await redis.start(serverArgs);
    // The payment system retries: until the instance is connected again, and while Redis is dropped, 503; then, while
    // the pool waits for its keys and its generation, 409 POOL_EXHAUSTED (as after a wipe); then the confirmed
    // reservation. Never a new one (the snapshot lacks the key, and has the item free).
    const answers: { status: number; body: any }[] = [];
    await eventually(async () => {
      const r = await api.post('/v1/pools/gate/reservations', body, { 'Idempotency-Key': 'order-3' });
      answers.push(r);
      return r.status !== 503 && !(r.status === 409 && r.body.error.code === 'POOL_EXHAUSTED');
    }, 10_000);
    expect(answers.at(-1)).toMatchObject({ status: 200, body: { id: made.body.id, state: 'confirmed' } });
    expect(answers.slice(0, -1).filter((r) => r.status !== 503 && r.status !== 409)).toEqual([]);
    expect(answers.some((r) => r.body.error?.code === 'DEPENDENCY_UNAVAILABLE' && /went back in time/.test(r.body.error.message))).toBe(
      true,
    );
    // (The rebuild the check started ends before the instance closes, for the tests after this one.)
    await untilRebuilt(api);
  });

  it('a read, extend, release or confirm on a new connection to a Redis gone back in time waits for the check too: none answers from, or acts on, the state the snapshot had', async () => {
    const { api, rebuilder } = await gatedInstance('stale', numbers(3, '1380000'));
    const made = await api.post('/v1/pools/stale/reservations', { owner: 'buyer', count: 2 });
    expect(made.status).toBe(201);
    const dropped = await api.post('/v1/pools/stale/reservations', { owner: 'changed-mind', count: 1 });
    expect(dropped.status).toBe(201);
    await withRedis((client) => client.save());
    // After the snapshot, which has both held: one confirmed, the other released.
    const kept = made.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${made.body.id}/confirm`, { resourceIds: [kept] })).status).toBe(200);
    expect((await api.del(`/v1/reservations/${dropped.body.id}`)).body.state).toBe('released');
    for (let i = 0; i < 3; i++) await step(rebuilder);

    await redis.stop();
    await redis.start(serverArgs);
    // All four at once, again and again, until none is answered 503 (the connection back, and Redis rebuilt).
    const path = `/v1/reservations/${made.body.id}`;
    const confirmLate = () => api.post(`/v1/reservations/${dropped.body.id}/confirm`, { resourceIds: [dropped.body.items[0].resourceId] });
    const answers: Record<'read' | 'extend' | 'release' | 'confirm', { status: number; body: any }[]> = {
      read: [],
      extend: [],
      release: [],
      confirm: [],
    };
    await eventually(async () => {
      const [read, extend, release, confirm] = await Promise.all([
        api.get(path),
        api.post(`${path}/extend`, { ttlMs: 60_000 }),
        api.del(path),
        confirmLate(),
      ]);
      Object.entries({ read, extend, release, confirm }).forEach(([name, r]) => answers[name as keyof typeof answers].push(r));
      return [read, extend, release, confirm].every((r) => r.status !== 503);
    }, 10_000);
    const gated = (r: { status: number; body: any }) => r.status === 503 && r.body.error.code === 'DEPENDENCY_UNAVAILABLE';
    expect(answers.read.filter((r) => !gated(r) && r.body.state !== 'confirmed')).toEqual([]);
    expect(answers.extend.filter((r) => !gated(r) && r.body.error?.code !== 'RESERVATION_CLOSED')).toEqual([]);
    expect(answers.release.filter((r) => !gated(r) && r.body.error?.code !== 'RESERVATION_CLOSED')).toEqual([]);
    // (Its record gone with the snapshot's data, the released reservation is unknown: 404.)
    expect(answers.confirm.filter((r) => !gated(r) && r.status !== 404)).toEqual([]);
    expect(
      Object.values(answers)
        .flat()
        .some((r) => /went back in time/.test(r.body.error?.message ?? '')),
    ).toBe(true);
    // Nothing was released: the confirmed item is still allocated, and no reserve gets it.
    await untilRebuilt(api);
    const allocated = await world.query<{ id: string }>(
      `SELECT r.id::text AS id FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'stale' AND r.state = 2`,
    );
    expect(allocated.map((row) => row.id)).toEqual([kept]);
    const after = await api.post('/v1/pools/stale/reservations', { owner: 'next', count: 2 });
    expect(after.status).toBe(201);
    expect(after.body.items.map((item: { resourceId: string }) => item.resourceId)).not.toContain(kept);
  });

  it('a confirm, extend or heartbeat received just before its hold ends, on a connection not checked yet, acts at once: the check (Postgres slow to answer it) does not hold it up past the hold', async () => {
    const setup = await quietInstance();
    await seedPool(setup, 'deadline', numbers(2, '1390000'));
    await seedPool(setup, 'deadline-tasks', numbers(1, '1391000'), { kind: 'task' });
    // Keys bound to their owners: each call also reads whose the reservation is before it acts (mustOwn).
    const key = (name: string) => ({ authorization: `Bearer ${name}-key-0123456789` });
    const a = await world.start({
      RECONCILE_INTERVAL_MS: '0',
      API_KEYS: ['client:payer', 'client:stayer', 'reviewer:reviewer']
        .map((entry) => `${entry.split(':')[0]}:${entry.split(':')[1]}-key-0123456789:${entry.split(':')[1]}`)
        .join(','),
    });
    onTestFinished(() => a.close());
    quietSweepers(a);
    const paying = await a.post('/v1/pools/deadline/reservations', { owner: 'payer', count: 1, ttlMs: 2000 }, key('payer'));
    const staying = await a.post('/v1/pools/deadline/reservations', { owner: 'stayer', count: 1, ttlMs: 2000 }, key('stayer'));
    const lease = await a.post('/v1/pools/deadline-tasks/tasks/next', { reviewer: 'reviewer', leaseMs: 2000 }, key('reviewer'));
    expect([paying.status, staying.status, lease.status]).toEqual([201, 201, 200]);
    const end = Math.min(...[paying.body, staying.body, lease.body].map((r) => Date.parse(r.expiresAt)));
    const until = (at: number) => sleep(Math.max(0, at - Date.now()));
    await newConnection(a);
    // The others (below) reserve through an instance whose new connection is checked already: their reserves do not
    // wait for the check either.
    await eventually(async () => (await setup.get(`/v1/reservations/${paying.body.id}`)).status === 200, 5000);
    // Postgres answers the check only after the holds' ends: a session holds the checkpoint's table until then.
    const locker = new pg.Client({ connectionString: databaseUrl(world.dbName) });
    await locker.connect();
    onTestFinished(() => locker.end());
    await locker.query('BEGIN');
    await locker.query('LOCK TABLE t_redis_checkpoint IN ACCESS EXCLUSIVE MODE');
    const unlocked = until(end + 1500).then(() => locker.query('COMMIT'));
    // Others take what comes free once the holds are over (after their grace, at the sweeper's next pass).
    const taken: string[] = [];
    const others = (async () => {
      await until(end + 300);
      while (Date.now() < end + 3000) {
        const [number, task] = await Promise.all([
          setup.post('/v1/pools/deadline/reservations', { owner: 'other', count: 1 }),
          setup.post('/v1/pools/deadline-tasks/tasks/next', { reviewer: 'other-reviewer' }),
        ]);
        for (const r of [number, task]) if (r.status === 201 || (r.status === 200 && r.body.leaseId)) taken.push(JSON.stringify(r.body));
        await sleep(20);
      }
    })();

    await until(end - 200);
    const sent = Date.now();
    const [confirm, extend, heartbeat] = await Promise.all([
      a.post(`/v1/reservations/${paying.body.id}/confirm`, { resourceIds: [paying.body.items[0].resourceId] }, key('payer')),
      a.post(`/v1/reservations/${staying.body.id}/extend`, { ttlMs: 60_000 }, key('stayer')),
      a.post(`/v1/tasks/${lease.body.leaseId}/heartbeat`, { leaseMs: 60_000 }, key('reviewer')),
    ]);
    // (They did wait for the check, which gave up on Postgres after a second.)
    expect(Date.now() - sent).toBeGreaterThanOrEqual(900);
    await Promise.all([others, unlocked]);
    expect([confirm.status, extend.status, heartbeat.status]).toEqual([200, 200, 200]);
    expect(taken).toEqual([]);
  });

  it('a heartbeat, complete or abandon of a lease a Redis gone back in time lacks answers 503 on a new connection, not 404 from that Redis', async () => {
    const a = await quietInstance();
    await seedPool(a, 'lost-leases', numbers(3, '1392000'), { kind: 'task' });
    for (const [call, body] of [
      ['heartbeat', { leaseMs: 60_000 }],
      ['complete', {}],
      ['abandon', {}],
    ] as const) {
      const lease = await a.post('/v1/pools/lost-leases/tasks/next', { reviewer: `reviewer-${call}` });
      expect(lease.status).toBe(200);
      await a.app.get(RebuildService).checkpoint();
      // As a snapshot taken before the lease was made would have it: no record of it, and the checkpoint behind.
      await withRedis((client) => client.del(poolKeys(world.prefix, 'lost-leases').reservation(lease.body.leaseId)));
      await makeBehind();
      await newConnection(a);
      const answer = await a.post(`/v1/tasks/${lease.body.leaseId}/${call}`, body);
      expect(answer.status, call).toBe(503);
      expect(answer.body.error.message, call).toMatch(/went back in time/);
      await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt' && (await redisCheckpoint()) === null, 10_000);
    }
  });

  it("no false alarm: a checkpoint step left half done is finished, a missing one starts at Postgres', and concurrent checks never find Redis behind", async () => {
    const [a, b] = [await world.start({ RECONCILE_INTERVAL_MS: '0' }), await world.start({ RECONCILE_INTERVAL_MS: '0' })];
    onTestFinished(async () => void (await Promise.all([a.close(), b.close()])));
    await untilRebuilt(a);
    quietSweepers(a, b);
    const [checkA, checkB] = [a, b].map((instance) => instance.app.get(RebuildService));
    await checkA.checkpoint();
    expect(await redisCheckpoint()).toBe(await postgresCheckpoint());

    // An instance raised Postgres' and died before Redis': the next check does it for it, and the steps go on.
    const before = await postgresCheckpoint();
    await world.query(`UPDATE t_redis_checkpoint SET n = n + 1, raised_at = now() - interval '1 minute'`);
    expect(await checkB.checkpoint()).toBe(false);
    expect(await redisCheckpoint()).toBe(before + 1);
    expect(await checkB.checkpoint()).toBe(false);
    expect([await postgresCheckpoint(), await redisCheckpoint()]).toEqual([before + 2, before + 2]);

    // No checkpoint in Redis (the first check after a rebuild, or of this version): it starts at Postgres'.
    await withRedis((client) => client.del(checkpointKey(world.prefix)));
    expect(await checkA.checkpoint()).toBe(false);
    expect(await redisCheckpoint()).toBe(await postgresCheckpoint());

    // Two instances checking at once, many times over: the number moves on once (a step at most every 900 ms, however
    // many check), and Redis is never found behind.
    await ageCheckpoint();
    const start = await postgresCheckpoint();
    const began = Date.now();
    const answers = await Promise.all(Array.from({ length: 40 }, (_, i) => (i % 2 === 0 ? checkA : checkB).checkpoint()));
    expect(answers.filter(Boolean)).toEqual([]);
    const end = await postgresCheckpoint();
    // (One more for each 900 ms the checks took, on a slow machine.)
    expect(end - start).toBeGreaterThanOrEqual(1);
    expect(end - start).toBeLessThanOrEqual(1 + Math.floor((Date.now() - began) / 900));
    expect(await redisCheckpoint()).toBeGreaterThanOrEqual(end - 1);

    // Postgres' clock set back: raised "later" than now, the number moves on all the same.
    await world.query(`UPDATE t_redis_checkpoint SET raised_at = now() + interval '1 hour'`);
    await checkA.checkpoint();
    await checkA.checkpoint();
    expect(await postgresCheckpoint()).toBe(end + 1);
  });

  it('Redis two steps behind is found; the rebuild drops it only while it is behind, once across instances', async () => {
    const [a, b] = [await world.start({ RECONCILE_INTERVAL_MS: '0' }), await world.start({ RECONCILE_INTERVAL_MS: '0' })];
    onTestFinished(async () => void (await Promise.all([a.close(), b.close()])));
    await seedPool(a, 'behind', numbers(4, '1390000'));
    await untilRebuilt(a);
    quietSweepers(a, b);
    const [rebuildA, rebuildB] = [a, b].map((instance) => instance.app.get(RebuildService));
    await rebuildA.checkpoint();

    // Not behind: a rebuild for a rollback drops nothing, and the hold stays.
    const held = await a.post('/v1/pools/behind/reservations', { owner: 'holder', count: 1 });
    expect(held.status).toBe(201);
    expect(await rebuildA.rebuild('rolledBack')).toBe(0);
    expect((await a.get(`/v1/reservations/${held.body.id}`)).body.state).toBe('held');

    // Two behind: found, and of two instances rebuilding at once, one drops Redis' keys (the hold with them).
    const postgres = await postgresCheckpoint();
    await withRedis((client) => client.set(checkpointKey(world.prefix), String(postgres - 2)));
    expect(await rebuildB.checkpoint()).toBe(true);
    const generation = await a.app.get(GenerationRepository).current();
    const free = Number((await world.query(`SELECT count(*) AS n FROM t_resource WHERE state = 1`))[0].n);
    const added = await Promise.all([rebuildA.rebuild('rolledBack'), rebuildB.rebuild('rolledBack')]);
    // One rebuilt every free item; the other found Redis no longer behind once it got the job (0), or found the job held.
    expect(added.filter((n) => n === free)).toHaveLength(1);
    expect(added.filter((n) => n === 0 || n === null)).toHaveLength(1);
    await untilRebuilt(a);
    expect(await a.app.get(GenerationRepository).current()).toBe(generation + 1);
    expect((await a.get(`/v1/reservations/${held.body.id}`)).status).toBe(404);
    expect(await a.app.get(HoldStore).freeCount('behind')).toBe(4);
    expect(await redisCheckpoint()).toBeNull(); // dropped: the next check starts it again at Postgres'
    expect(await rebuildB.checkpoint()).toBe(false);
    expect(await redisCheckpoint()).toBe(await postgresCheckpoint());
  });

  it('a checkpoint write is refused once another instance wrote it, or Redis was rebuilt, since it was read', async () => {
    const a = await quietInstance();
    const holds = a.app.get(HoldStore);
    const rebuilder = a.app.get(RebuildService);
    await rebuilder.checkpoint();
    const seen = await holds.checkpoint();
    await step(rebuilder); // another step since the read
    expect(await holds.setCheckpoint({ ...seen, marker: seen.marker! }, 1)).toBe(false);
    expect(await redisCheckpoint()).toBe(await postgresCheckpoint());

    // Read with no checkpoint; then Redis is wiped and rebuilt (a new marker, no checkpoint either): the read is stale.
    await withRedis((client) => client.del(checkpointKey(world.prefix)));
    const before = await holds.checkpoint();
    await withRedis((client) => client.flushall());
    expect(await rebuilder.rebuild('wiped')).not.toBeNull();
    expect(await holds.setCheckpoint({ ...before, marker: before.marker! }, 1)).toBe(false);
    expect(await redisCheckpoint()).toBeNull();
  });

  it("a missing checkpoint starts at a Postgres read made after it was found missing; Postgres' is read before Redis'", async () => {
    const [a, b] = [await quietInstance(), await quietInstance()];
    const rebuilder = a.app.get(RebuildService);
    const generations = a.app.get(GenerationRepository);
    const read = generations.checkpoint.bind(generations);
    const spy = vi.spyOn(generations, 'checkpoint');
    onTestFinished(() => spy.mockRestore());

    // Other instances move Postgres' on between this one's first read and its read of Redis: it starts from where
    // Postgres is then, not from its first read (two behind, that would be found behind at the next check).
    await withRedis((client) => client.del(checkpointKey(world.prefix)));
    spy.mockImplementationOnce(async () => {
      const n = await read();
      await world.query(`UPDATE t_redis_checkpoint SET n = n + 3`);
      return n;
    });
    expect(await rebuilder.checkpoint()).toBe(false);
    expect(await redisCheckpoint()).toBe(await postgresCheckpoint());
    expect(await rebuilder.checkpoint()).toBe(false);

    // Another instance takes two steps just before this one reads Postgres: Redis, read after, has them too.
    spy.mockImplementationOnce(async () => {
      await step(b.app.get(RebuildService));
      await step(b.app.get(RebuildService));
      return read();
    });
    expect(await rebuilder.checkpoint()).toBe(false);
  });

  it('a rebuild that stalled after it found Redis behind, while another instance rebuilt it, drops nothing of the rebuilt Redis', async () => {
    const [a, b] = [await quietInstance(), await quietInstance()];
    await seedPool(a, 'stall', numbers(3, '1360000'));
    await a.app.get(RebuildService).checkpoint();
    await makeBehind();
    // A finds Redis behind (its read of Redis' checkpoint), then stalls before its drop.
    let resume!: () => void;
    let reached!: () => void;
    const stall = new Promise<void>((resolve) => (resume = resolve));
    const atStall = new Promise<void>((resolve) => (reached = resolve));
    const holdsA = a.app.get(HoldStore);
    const read = holdsA.checkpoint.bind(holdsA);
    const spy = vi.spyOn(holdsA, 'checkpoint').mockImplementationOnce(async () => {
      const seen = await read();
      reached();
      await stall;
      return seen;
    });
    onTestFinished(() => spy.mockRestore());
    const stalled = a.app.get(RebuildService).rebuild('rolledBack');
    await atStall;

    // Its lease runs out; B takes the job, drops Redis and rebuilds it; a buyer holds an item of the rebuilt Redis.
    await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'rebuild'`);
    expect(await b.app.get(RebuildService).rebuild('rolledBack')).toBeGreaterThan(0);
    const generation = await b.app.get(GenerationRepository).current();
    const held = await b.post('/v1/pools/stall/reservations', { owner: 'after', count: 1 });
    expect(held.status).toBe(201);

    // A goes on: its drop takes nothing of what B rebuilt, and it stops at its next step (the job is no longer its).
    resume();
    expect(await stalled).toBeNull();
    expect((await b.get(`/v1/reservations/${held.body.id}`)).body.state).toBe('held');
    expect((await b.post(`/v1/reservations/${held.body.id}/confirm`, { resourceIds: [held.body.items[0].resourceId] })).status).toBe(200);
    expect(await b.app.get(GenerationRepository).current()).toBe(generation);
    expect(await b.app.get(HoldStore).rebuildState()).toBe('rebuilt');
    expect(await b.app.get(HoldStore).freeCount('stall')).toBe(2);
  });

  it('while a drop runs, reserves find nothing; a drop that dies midway leaves Redis found behind, and is done again', async () => {
    const a = await quietInstance();
    await seedPool(a, 'midway', numbers(3, '1350000'));
    const rebuilder = a.app.get(RebuildService);
    await rebuilder.checkpoint();
    // A first reserve: the check of this instance's connection is done, and what follows is the drop's doing.
    expect((await a.post('/v1/pools/midway/reservations', { owner: 'first', count: 1 })).status).toBe(201);
    await makeBehind();
    let during: { status: number; body: any } | undefined;
    const renew = vi.spyOn(rebuilder as unknown as { renewLease: () => Promise<void> }, 'renewLease').mockImplementationOnce(async () => {
      // After the first page of the walk: the pools have no generation, so a reserve takes nothing.
      during = await a.post('/v1/pools/midway/reservations', { owner: 'during', count: 1 });
      throw new Error('the instance died midway');
    });
    onTestFinished(() => renew.mockRestore());
    await expect(rebuilder.rebuild('rolledBack')).rejects.toThrow('the instance died midway');
    expect(during?.body.error?.code).toBe('POOL_EXHAUSTED');

    expect(await rebuilder.checkpoint()).toBe(true);
    expect(await rebuilder.rebuild('rolledBack')).toBeGreaterThan(0);
    expect(await a.app.get(HoldStore).rebuildState()).toBe('rebuilt');
    expect((await a.post('/v1/pools/midway/reservations', { owner: 'after', count: 1 })).status).toBe(201);
  });

  it('a Redis whose marker says a rebuild is running is found behind too, and the checkpoint goes on meanwhile', async () => {
    const a = await quietInstance();
    const holds = a.app.get(HoldStore);
    const rebuilder = a.app.get(RebuildService);
    const marker = (await holds.marker())!;
    onTestFinished(() => holds.setMarker(marker));
    // As restored from a snapshot taken while a rebuild ran (or as a rebuild that ends in such a Redis finds it).
    await holds.setMarker('7 rebuilding:another-instance:1:1:current');
    await rebuilder.checkpoint();
    const before = await postgresCheckpoint();
    expect(await step(rebuilder)).toBe(false);
    expect(await postgresCheckpoint()).toBe(before + 1);
    await makeBehind();
    expect(await rebuilder.checkpoint()).toBe(true);
  });

  it('a check of a new connection that Postgres cannot answer lets reserves go on, backing off 1 s, then 2 s; a newer connection is checked at once', async () => {
    const a = await quietInstance();
    await seedPool(a, 'unchecked', numbers(3, '1340000'));
    await a.app.get(RebuildService).checkpoint();
    await makeBehind();
    const generations = a.app.get(GenerationRepository);
    const spy = vi
      .spyOn(generations, 'checkpoint')
      .mockRejectedValueOnce(new Error('postgres is down'))
      .mockRejectedValueOnce(new Error('postgres is down'));
    onTestFinished(() => spy.mockRestore());
    // A new connection (the server closes the instance's, which ioredis opens again).
    await newConnection(a);
    const reserve = (owner: string) => a.post('/v1/pools/unchecked/reservations', { owner, count: 1 });
    expect((await reserve('while-down')).status).toBe(201);
    expect(spy).toHaveBeenCalledTimes(1);
    await sleep(1100);
    expect((await reserve('still-down')).status).toBe(201);
    expect(spy).toHaveBeenCalledTimes(2);
    await sleep(1100); // within the 2 s after the second: not checked
    expect((await reserve('unchecked')).status).toBe(201);
    expect(spy).toHaveBeenCalledTimes(2);
    // A new connection is checked at once, backing off or not.
    await newConnection(a);
    const later = await reserve('once-up');
    expect(later.body.error?.code).toBe('DEPENDENCY_UNAVAILABLE');
    expect(spy.mock.calls.length).toBeGreaterThanOrEqual(3); // (and the rebuild that check started reads it too)
    await eventually(async () => (await a.app.get(HoldStore).rebuildState()) === 'rebuilt' && (await redisCheckpoint()) === null, 10_000);
  });

  it("a holder that stalled after its check and wakes while another instance puts a pool's Idempotency-Keys back leaves them", async () => {
    const [a, b] = [await quietInstance(), await quietInstance()];
    await seedPool(a, 'restore', numbers(3, '1330000'));
    const body = { owner: 'buyer', count: 1 };
    const made = await a.post('/v1/pools/restore/reservations', body, { 'Idempotency-Key': 'order-9' });
    expect((await a.post(`/v1/reservations/${made.body.id}/confirm`, { resourceIds: [made.body.items[0].resourceId] })).status).toBe(200);
    await a.app.get(RebuildService).checkpoint();
    await makeBehind();

    // A finds Redis behind, then stalls.
    /** The next call of `method` that `when` picks pauses after it has run, until resumed. */
    const pauseAfter = <T extends object>(target: T, method: keyof T & string, when: (...args: any[]) => boolean = () => true) => {
      let resume!: () => void;
      let reached!: () => void;
      const resumed = new Promise<void>((resolve) => (resume = resolve));
      const atPause = new Promise<void>((resolve) => (reached = resolve));
      const original = (target[method] as (...args: unknown[]) => Promise<unknown>).bind(target);
      let paused = false;
      const spy = vi.spyOn(target, method as never).mockImplementation((async (...args: unknown[]) => {
        const result = await original(...args);
        if (!paused && when(...args)) {
          paused = true;
          reached();
          await resumed;
        }
        return result;
      }) as never);
      onTestFinished(() => spy.mockRestore());
      return { resume, atPause };
    };
    const stallA = pauseAfter(a.app.get(HoldStore), 'checkpoint');
    const stalled = a.app.get(RebuildService).rebuild('rolledBack');
    await stallA.atPause;
    // B takes the job, drops Redis, and stalls after it put the pools' keys back, before their generations.
    await world.query(`UPDATE t_job_mutex SET update_time = now() - interval '2 minutes' WHERE job_type = 'rebuild'`);
    const stallB = pauseAfter(b.app.get(HoldStore), 'restoreIdempotencyKeys', (pool: string) => pool === 'restore');
    const rebuilding = b.app.get(RebuildService).rebuild('rolledBack');
    await stallB.atPause;
    // A wakes, and drops what it may: nothing of the pool whose keys are being put back.
    stallA.resume();
    expect(await stalled).toBeNull();
    stallB.resume();
    expect(await rebuilding).toBeGreaterThan(0);
    const retry = await b.post('/v1/pools/restore/reservations', body, { 'Idempotency-Key': 'order-9' });
    expect(retry).toMatchObject({ status: 200, body: { id: made.body.id, state: 'confirmed' } });
  });

  it('a rebuild round of a stalled instance that writes its marker during a drop does not keep the checkpoint behind: the rebuilt Redis is not dropped again', async () => {
    const a = await quietInstance();
    await seedPool(a, 'round', numbers(3, '1320000'));
    const rebuilder = a.app.get(RebuildService);
    await rebuilder.checkpoint();
    await makeBehind();
    const renew = vi.spyOn(rebuilder as unknown as { renewLease: () => Promise<void> }, 'renewLease').mockImplementationOnce(async () => {
      // Mid-drop: an instance whose lease ran out while it stalled starts a round (it writes the marker unfenced).
      await a.app.get(HoldStore).setMarker('3 rebuilding:stalled-instance:1:1:current');
    });
    onTestFinished(() => renew.mockRestore());
    expect(await rebuilder.rebuild('rolledBack')).toBeGreaterThan(0);
    const held = await a.post('/v1/pools/round/reservations', { owner: 'after', count: 1 });
    expect(held.status).toBe(201);
    expect(await rebuilder.checkpoint()).toBe(false);
    expect(await rebuilder.checkpoint()).toBe(false);
    expect((await a.post(`/v1/reservations/${held.body.id}/confirm`, { resourceIds: [held.body.items[0].resourceId] })).status).toBe(200);
  });
});
