/**
 * respool chaos suite: three instances as separate processes on a Postgres and a Redis of the suite's
 * own, about 1,000 simulated clients, and one fault at a time with recovery in between. Fails on any
 * violation of the invariants (see checker.ts). `--full` runs longer phases.
 *
 *   npm run test:chaos            # short form, every fault once (CI)
 *   npm run test:chaos -- --full  # longer load between and around faults
 */
import { Redis } from 'ioredis';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { poolKeys } from '../../src/redis/keys.js';
import { OwnRedis, freePort } from '../support/services.js';
import { FaultWindow, FlowSampler, HoldSampler, check } from './checker.js';
import { Traffic, buyer, reviewer } from './clients.js';
import { ProxyProcess } from './proxy-process.js';
import { ChaosPostgres, Instance } from './cluster.js';

const FULL = process.argv.includes('--full');
const PHASE_MS = FULL ? 20_000 : 6_000; // load before, between and after faults
const BUYERS = 800;
const REVIEWERS = 200;
const NUMBERS = 3000;
const TASKS = 1000;
const REQUEST_TIMEOUT_MS = 15_000;
const PREFIX = 'chaos:';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const say = (msg: string) => console.log(`[chaos ${new Date().toISOString().slice(11, 23)}] ${msg}`);

async function waitReady(instances: Instance[], timeoutMs = 30_000): Promise<number> {
  const started = Date.now();
  for (;;) {
    const up = instances.filter((i) => i.state === 'up');
    const ready = await Promise.all(
      up.map((i) =>
        fetch(`${i.url}/health/ready`, { signal: AbortSignal.timeout(2000) })
          .then((r) => r.ok)
          .catch(() => false),
      ),
    );
    if (ready.every(Boolean)) return Date.now() - started;
    if (Date.now() - started > timeoutMs) throw new Error('instances did not become ready again');
    await sleep(100);
  }
}

async function api(instance: Instance, method: string, path: string, body?: unknown) {
  const res = await fetch(`${instance.url}${path}`, {
    method,
    headers: body === undefined ? {} : { 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
    // A step of a scenario that gets no answer fails the run at once rather than after undici's 5 minutes.
    signal: AbortSignal.timeout(30_000),
  });
  const text = await res.text();
  return { status: res.status, body: text ? JSON.parse(text) : undefined };
}

/**
 * Postgres, Redis and the proxy in front of it; should one fail to start, those started are stopped again. Redis
 * starts with `redisArgs`, always (it loads the snapshot named there, if there is one).
 */
async function startServices(redisArgs: string[]): Promise<{ pg: ChaosPostgres; redis: OwnRedis; proxy: ProxyProcess }> {
  const pg = await ChaosPostgres.create();
  let redis: OwnRedis | undefined;
  try {
    redis = await OwnRedis.start(redisArgs);
    return { pg, redis, proxy: await ProxyProcess.start(redis.port) };
  } catch (err) {
    await redis?.stop().catch(() => undefined);
    pg.destroy();
    throw err;
  }
}

async function main(): Promise<number> {
  const workDir = mkdtempSync(join(tmpdir(), 'respool-chaos-'));
  say(`${FULL ? 'full' : 'short'} run; logs in ${workDir}`);
  // Redis writes a snapshot only when told to (SAVE), into the run's directory, and loads it when it starts.
  const snapshot = join(workDir, 'redis-snapshot.rdb');
  const redisArgs = ['--dir', workDir, '--dbfilename', 'redis-snapshot.rdb'];
  const { pg, redis, proxy } = await startServices(redisArgs);
  const env = {
    DATABASE_URL: pg.url,
    REDIS_URL: `redis://127.0.0.1:${proxy.port}`,
    REDIS_KEY_PREFIX: PREFIX,
    LOG_LEVEL: 'info',
    LOG_REQUESTS: 'false',
    DB_TIMEOUT_MS: '2000',
    REDIS_TIMEOUT_MS: '1000',
    COMMIT_WINDOW_MS: '2000',
    SWEEP_INTERVAL_MS: '200',
    RECONCILE_INTERVAL_MS: '10000',
    DB_POOL_SIZE: '20',
  };
  const instances: Instance[] = [];
  for (const name of ['a', 'b', 'c']) instances.push(new Instance(name, await freePort(), env, join(workDir, `instance-${name}.log`)));
  const direct = new Redis(redis.url, { maxRetriesPerRequest: 1, enableOfflineQueue: false, retryStrategy: () => 200 });
  direct.on('error', () => undefined);
  const windows: FaultWindow[] = [];
  const recovery: Record<string, number> = {};
  const traffic = new Traffic(instances, REQUEST_TIMEOUT_MS);
  let failed: boolean;

  try {
    await instances[0].start(); // migrates the database
    await Promise.all(instances.slice(1).map((i) => i.start()));
    const [a, b, c] = instances;
    await api(a, 'POST', '/v1/pools', { name: 'numbers', kind: 'number', holdTtlMs: 3000, maxHoldTtlMs: 60_000 });
    await api(a, 'POST', '/v1/pools', { name: 'reviews', kind: 'task', holdTtlMs: 3000, maxHoldTtlMs: 60_000 });
    await api(a, 'POST', '/v1/pools', { name: 'pause', kind: 'number', holdTtlMs: 1500, maxHoldTtlMs: 60_000 });
    const numbers = Array.from({ length: NUMBERS }, (_, i) => ({ value: `1380${String(i).padStart(7, '0')}` }));
    for (let i = 0; i < numbers.length; i += 5000)
      await api(a, 'POST', '/v1/pools/numbers/resources', { items: numbers.slice(i, i + 5000) });
    const tasks = Array.from({ length: TASKS }, (_, i) => ({ value: `task-${i}`, groupKey: `submitter-${i % 50}` }));
    await api(a, 'POST', '/v1/pools/reviews/resources', { items: tasks });
    await api(a, 'POST', '/v1/pools/pause/resources', { items: [{ value: 'the-one' }] });

    const sampler = new HoldSampler(direct, [`${PREFIX}{numbers}:`, `${PREFIX}{reviews}:`]);
    const flowSampler = new FlowSampler(direct, pg.url, { numbers: `${PREFIX}{numbers}:`, reviews: `${PREFIX}{reviews}:` }, windows);
    const sampling = (async () => {
      while (!traffic.stopped) {
        await sampler.sample();
        await sleep(500);
      }
    })();
    const flowSampling = (async () => {
      while (!traffic.stopped) {
        await flowSampler.sample();
        await sleep(250);
      }
      await flowSampler.close();
    })();
    say(`load: ${BUYERS} buyers, ${REVIEWERS} reviewers on ${NUMBERS} numbers and ${TASKS} tasks`);
    const clients = [
      ...Array.from({ length: BUYERS }, (_, i) => buyer(traffic, String(i), 'numbers')),
      ...Array.from({ length: REVIEWERS }, (_, i) => reviewer(traffic, String(i), 'reviews')),
    ];

    const fault = async (kind: string, inject: () => Promise<Partial<FaultWindow> | void>) => {
      await sleep(PHASE_MS);
      say(`fault: ${kind}`);
      const window: FaultWindow = { kind, start: Date.now(), end: 0 };
      windows.push(window);
      Object.assign(window, (await inject()) ?? {});
      const recovered = Date.now();
      recovery[kind] = await waitReady(instances);
      window.end = Date.now();
      say(`recovered from ${kind}: ready ${recovery[kind]} ms after the fault was lifted (${window.end - window.start} ms in all)`);
      void recovered;
    };

    await fault('redis FLUSHALL', async () => {
      await direct.flushall();
      return { redisLostBy: Date.now() };
    });
    await fault('redis kill -9, restarted empty', async () => {
      await redis.stop();
      const redisLostBy = Date.now();
      await sleep(2000);
      await redis.start(redisArgs);
      return { redisLostBy };
    });
    // Redis goes back in time, its marker kept: the instances find it behind by its checkpoint, drop it and rebuild.
    await fault('redis restored from a snapshot 4 s old', async () => {
      await direct.save();
      await sleep(4000);
      await redis.stop();
      const redisLostBy = Date.now();
      await redis.start(redisArgs);
      rmSync(snapshot);
      return { redisLostBy, rollback: true };
    });
    await fault('postgres immediate shutdown', async () => {
      pg.stopImmediate();
      await sleep(3000);
      await pg.start();
    });
    await fault('kill -9 of an instance during confirms', async () => {
      b.kill9();
      await sleep(2000);
      await b.start();
      return { instance: 'b' };
    });
    await fault('pause an instance inside a confirm past the TTL (SIGSTOP/SIGCONT)', async () => {
      await pauseScenario(a, b, c, pg.url, proxy);
      return { instance: 'a' };
    });
    await fault('slow Redis: latency, then dropped connections', async () => {
      await proxy.setLatency(20);
      await sleep(4000);
      await proxy.setLatency(0);
      await proxy.cut();
      await sleep(2000);
      await proxy.open();
    });

    // The last phase is long enough for the flow sampler to judge items that went missing after the last fault.
    await sleep(Math.max(PHASE_MS, 16_000));
    say('stopping the load');
    traffic.stopped = true;
    await Promise.all(clients);
    await sampling;
    await flowSampling;

    // Give back every hold still open, then the whole pool must be free again within 5 s (and then reservable).
    const stopAt = Date.now();
    await releaseOpenHolds(traffic, a);
    const flow = await wholePoolReservable(a, pg.url, direct, traffic);
    const flowMs = flow.freeAt - stopAt;
    say(`whole pool free again ${flowMs} ms after the load stopped; then ${flow.numbers} numbers and ${flow.tasks} tasks taken, each once`);

    // Graceful shutdown: requests in flight when SIGTERM arrives are all answered, then the process exits 0.
    await proxy.setLatency(150);
    const inFlight = Array.from({ length: 50 }, (_, i) =>
      api(c, 'POST', '/v1/pools/numbers/reservations', { owner: `sigterm-${i}`, count: 1 }).catch((err: Error) => ({
        status: 0,
        body: err.message,
      })),
    );
    await sleep(100);
    const shutdown = await c.terminate();
    const answered = await Promise.all(inFlight);
    await proxy.setLatency(0);
    const unanswered = answered.filter((r) => r.status !== 201 && r.status !== 409);
    say(`SIGTERM with 50 requests in flight: exit code ${shutdown.code} after ${shutdown.ms} ms; ${50 - unanswered.length} answered`);

    const verdict = await check(traffic.log, windows, pg.url);
    verdict.violations.push(...sampler.violations, ...flowSampler.violations, ...flow.violations);
    if (flowSampler.samples < 5) verdict.violations.push(`flow sampler could sample only ${flowSampler.samples} times`);
    if (shutdown.code !== 0) verdict.violations.push(`graceful shutdown exited with ${shutdown.code}`);
    for (const r of unanswered) verdict.violations.push(`request in flight at SIGTERM got ${r.status} ${JSON.stringify(r.body)}`);
    if (flowMs > 5000) verdict.violations.push(`the pool took ${flowMs} ms to become reservable again`);
    if (sampler.samplesWithHolds < 5) verdict.violations.push(`hold sampler saw live holds only ${sampler.samplesWithHolds} times`);
    if (verdict.counts.commitsRepeated === 0 || verdict.counts.commitsRefused === 0) {
      verdict.violations.push(
        'no confirm answered 200 twice, or none refused in all its attempts: the checks of their answers went untested',
      );
    }
    if (verdict.counts.keyedReplaysAcrossRedisLoss === 0) {
      verdict.violations.push('no keyed reserve was retried, and answered, across a loss of Redis data: the case went untested');
    }
    if (verdict.counts.keyedReplaysAcrossRollback === 0) {
      verdict.violations.push(
        'no keyed reserve confirmed after the snapshot was retried, and answered, after Redis went back to it: the case went untested',
      );
    }
    const per503 = Object.fromEntries(
      windows.map((w) => [w.kind, traffic.log.filter((e) => e.status === 503 && e.sentAt <= w.end + 3000 && e.doneAt >= w.start).length]),
    );
    const report = {
      mode: FULL ? 'full' : 'short',
      ...verdict.counts,
      '503ByFault': per503,
      holdSamples: sampler.samples,
      flowSamples: flowSampler.samples,
      flowLongestMissingMs: flowSampler.longestMissingMs,
      recoveryMs: recovery,
      wholePoolReservableMs: flowMs,
      gracefulShutdownMs: shutdown.ms,
      violations: verdict.violations.length,
    };
    writeFileSync(
      join(workDir, 'report.json'),
      JSON.stringify({ report, violations: verdict.violations, diagnostics: verdict.diagnostics, windows }, null, 2),
    );
    console.log(JSON.stringify(report, null, 2));
    for (const v of verdict.violations.slice(0, 50)) console.log(`VIOLATION ${v}`);
    for (const d of verdict.diagnostics.slice(0, 20)) console.log(`DIAGNOSTIC ${d}`);
    failed = verdict.violations.length > 0;
    say(failed ? `FAILED: ${verdict.violations.length} violations` : 'passed: 0 violations');
  } catch (err) {
    failed = true;
    console.error(err);
  } finally {
    traffic.stopped = true;
    await Promise.all(instances.map((i) => i.stop().catch(() => undefined)));
    direct.disconnect();
    await proxy.stop();
    await redis.stop();
    pg.destroy();
  }
  if (failed || process.env.CHAOS_KEEP_LOGS === '1') say(`logs and report.json kept in ${workDir}`);
  else rmSync(workDir, { recursive: true, force: true });
  return failed ? 1 : 0;
}

/**
 * DESIGN.md's pause scenario: an instance stops inside a confirm for longer than the hold's TTL;
 * meanwhile another client reserves and confirms the same item; once resumed, the paused confirm must
 * fail (the version check fences it) and never allocate.
 */
async function pauseScenario(a: Instance, b: Instance, c: Instance, databaseUrl: string, proxy: ProxyProcess): Promise<void> {
  const pg = (await import('pg')).default;
  for (let attempt = 1; attempt <= 5; attempt++) {
    const r = await api(b, 'POST', '/v1/pools/pause/reservations', { owner: 'paused-buyer', ttlMs: 1500 });
    if (r.status !== 201) throw new Error(`pause scenario: reserve ${r.status} ${JSON.stringify(r.body)}`);
    const id = r.body.items[0].resourceId;
    // Redis answers slowly for a moment, so the confirm (two scripts, each a round trip through the proxy)
    // is still in flight when the instance is stopped.
    await proxy.setLatency(50);
    // The proxy process stops the instance as soon as the pin is in Redis: the pin's answer is then still on its
    // way back through the slowed proxy, so the instance stops between its pin and its commit.
    const stopped = proxy.stopWhenPinned(poolKeys(PREFIX, 'pause').reservation(r.body.id), a.pid!, 3000);
    const paused = fetch(`${a.url}/v1/reservations/${r.body.id}/confirm`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ resourceIds: [id] }),
      signal: AbortSignal.timeout(60_000),
    }).then(async (res) => ({ status: res.status, body: (await res.json()) as any }));
    paused.catch(() => undefined); // awaited below; a failure meanwhile must not end the process unhandled
    const pinSeen = await stopped;
    a.pause(); // stopped already (or now, if the pin was never seen)
    await proxy.setLatency(0);
    // Longer than the TTL and the commit window: the sweepers of b and c hand the item back.
    let rival: { status: number; body: any } | undefined;
    const until = Date.now() + 10_000;
    await sleep(1500);
    while (Date.now() < until) {
      const t = await api(b, 'POST', '/v1/pools/pause/reservations', { owner: 'rival' });
      if (t.status === 201) {
        rival = await api(c, 'POST', `/v1/reservations/${t.body.id}/confirm`, { resourceIds: [id] });
        break;
      }
      await sleep(200);
    }
    a.resume();
    const victim = await paused;
    if (!rival) {
      // The confirm finished before the pause took hold: give the item back and try again.
      if (victim.status !== 200) throw new Error(`pause scenario: no rival could reserve, paused confirm ${victim.status}`);
      await api(b, 'POST', `/v1/pools/pause/resources/${id}/release`, { owner: 'paused-buyer' });
      say(
        `pause scenario attempt ${attempt}: the confirm finished before SIGSTOP (pin ${pinSeen === null ? 'not seen' : `seen after ${pinSeen} ms`}); again`,
      );
      continue;
    }
    const sql = new pg.Client({ connectionString: databaseUrl });
    await sql.connect();
    const rows = (await sql.query(`SELECT owner, state FROM t_resource WHERE id = $1`, [id])).rows;
    await sql.end();
    say(
      `pause scenario: rival confirm ${rival.status}, paused confirm ${victim.status} ${victim.body?.error?.code ?? ''}; owner now ${rows[0].owner}`,
    );
    // The paused confirm is fenced in Postgres (its commit epoch was given up, the version moved on) and says so.
    if (rival.status !== 200 || victim.status !== 409 || victim.body?.error?.code !== 'HOLD_LOST' || rows[0].owner !== 'rival') {
      throw new Error(`pause scenario violated: rival ${rival.status}, paused ${victim.status}, owner ${rows[0].owner}`);
    }
    await api(b, 'POST', `/v1/pools/pause/resources/${id}/release`, { owner: 'rival' });
    return;
  }
  throw new Error('pause scenario: could not pause an instance inside a confirm in 5 attempts');
}

/** Deletes every reservation and abandons every lease the clients left open. */
async function releaseOpenHolds(t: Traffic, at: Instance): Promise<void> {
  const closed = new Set<string>();
  const opened = new Map<string, { id: string; lease: boolean; expiresAt: number }>();
  for (const e of t.log) {
    if (e.op === 'reserve' && e.status === 201)
      opened.set(e.answer.id, { id: e.answer.id, lease: false, expiresAt: Date.parse(e.answer.expiresAt) });
    if (e.op === 'pull' && e.status === 200)
      opened.set(e.answer.leaseId, { id: e.answer.leaseId, lease: true, expiresAt: Date.parse(e.answer.expiresAt) });
    if (e.op === 'heartbeat' && e.status === 200) {
      const lease = opened.get(e.path.split('/')[3]);
      if (lease) lease.expiresAt = Date.parse(e.answer.expiresAt);
    }
    if (['confirm', 'release'].includes(e.op) && e.status === 200) closed.add(e.path.split('/')[3]);
    if (['complete', 'abandon'].includes(e.op) && e.status === 200) closed.add(e.path.split('/')[3]);
  }
  // Holds already past their expiry need nothing from their owner: the sweeper returns them.
  const now = Date.now();
  const open = [...opened.values()].filter((o) => !closed.has(o.id) && o.expiresAt > now);
  for (let i = 0; i < open.length; i += 200) {
    await Promise.all(
      open
        .slice(i, i + 200)
        .map((o) =>
          (o.lease ? api(at, 'POST', `/v1/tasks/${o.id}/abandon`) : api(at, 'DELETE', `/v1/reservations/${o.id}`)).catch(() => undefined),
        ),
    );
  }
}

/**
 * Waits until every unallocated item is free (`freeAt`), then takes them all: none may be allocated already,
 * and each is taken once.
 */
async function wholePoolReservable(at: Instance, databaseUrl: string, redis: Redis, traffic: Traffic) {
  const violations: string[] = [];
  const result = { numbers: 0, tasks: 0, violations, freeAt: 0 };
  const deadline = Date.now() + 15_000;
  for (const pool of ['numbers', 'reviews'] as const) {
    for (;;) {
      const stats = (await api(at, 'GET', `/v1/pools/${pool}`)).body.stats;
      if (stats.free === stats.total - stats.allocated) break;
      if (Date.now() > deadline) {
        violations.push(`${pool}: only ${stats.free} of ${stats.total - stats.allocated} unallocated items free`);
        break;
      }
      await sleep(100);
    }
  }
  result.freeAt = Date.now();
  const pg = (await import('pg')).default;
  const sql = new pg.Client({ connectionString: databaseUrl });
  await sql.connect();
  try {
    const allocated = new Set((await sql.query(`SELECT id::text FROM t_resource WHERE state = 2`)).rows.map((r) => r.id));
    const taken = new Set<string>();
    for (;;) {
      // Holds and leases long enough that none of them expires, and comes back, while everything is taken.
      const r = await api(at, 'POST', '/v1/pools/numbers/reservations', { owner: 'final-sweep', count: 100, ttlMs: 60_000 });
      if (r.status !== 201) {
        const single = await api(at, 'POST', '/v1/pools/numbers/reservations', { owner: 'final-sweep', count: 1, ttlMs: 60_000 });
        if (single.status !== 201) break;
        r.body = single.body;
      }
      for (const item of r.body.items) {
        if (allocated.has(item.resourceId)) violations.push(`allocated item ${item.resourceId} was reservable`);
        taken.add(item.resourceId);
      }
      result.numbers += r.body.items.length;
    }
    for (;;) {
      const r = await api(at, 'POST', '/v1/pools/reviews/tasks/next', { reviewer: 'final-sweep', leaseMs: 60_000 });
      if (r.status !== 200) break;
      if (allocated.has(r.body.resourceId)) violations.push(`allocated task ${r.body.resourceId} was leased`);
      taken.add(r.body.resourceId);
      result.tasks++;
    }
    // Free in Postgres but never handed out: say what Redis holds about each (a few), to find out why.
    const stuck = (
      await sql.query<{ id: string; pool: string; version: number }>(
        `SELECT r.id::text AS id, p.name AS pool, r.version FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE r.state = 1 AND p.name <> 'pause'`,
      )
    ).rows.filter((row) => !taken.has(row.id));
    for (const row of stuck.slice(0, 5)) {
      const keys = poolKeys(PREFIX, row.pool);
      const holder = await redis.get(keys.hold(row.id)).catch(() => '?');
      const ttl = await redis.pttl(keys.hold(row.id)).catch(() => -3);
      const cached = await redis.hget(keys.itemBucket(row.id), row.id).catch(() => '?');
      const reservation = holder && !holder.startsWith('A:') ? await redis.hgetall(keys.reservation(holder)).catch(() => ({})) : {};
      const fields = Object.fromEntries(Object.entries(reservation as Record<string, string>).filter(([k]) => k !== 'i' && k !== 'x'));
      const requests = holder
        ? traffic.log
            .filter((e) => e.path.includes(holder.split('.')[1] ?? holder) || (e.op === 'reserve' && e.answer?.id === holder))
            .map((e) => `${e.op} on ${e.instance} ${new Date(e.sentAt).toISOString().slice(11, 23)} -> ${e.status}`)
        : [];
      violations.push(
        `stuck item ${row.pool}/${row.id} v${row.version}: hold ${holder} (${ttl} ms), cache ${cached}, reservation ${JSON.stringify(fields)}, requests: ${requests.join('; ')}`,
      );
    }
    const free = (
      await sql.query(
        `SELECT p.name, count(*)::int AS n FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE r.state = 1 GROUP BY p.name`,
      )
    ).rows;
    const expected = Object.fromEntries(free.map((r) => [r.name, r.n]));
    if (result.numbers !== expected.numbers) violations.push(`numbers: reserved ${result.numbers}, Postgres has ${expected.numbers} free`);
    if (result.tasks !== expected.reviews) violations.push(`tasks: leased ${result.tasks}, Postgres has ${expected.reviews} free`);
  } finally {
    await sql.end();
  }
  return result;
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);
