/**
 * `npm run bench:wait`: how soon a reserve that waits (waitMs) gets an item that comes free, with the wake-ups
 * (WAIT_WAKE_UPS=true, the default: the scripts that free items publish them and the waiters they match try again
 * at once) and without them (WAIT_WAKE_UPS=false: waiters find items by trying again, the first in line every
 * 50-75 ms, the others every 250-375 ms). Both services run on this machine at once, each on its own pool and key
 * prefix, and are measured in turn, round after round, so that the machine's drift falls on both alike.
 *
 * A sample, on a pool whose items are all held, with WAITERS reserves of 1 waiting on it: one held item is
 * released (DELETE), and the latency is from the release's request to the first waiter's 201 (the release's own
 * round trip included: a waiter woken may answer before it); the waiter served is
 * replaced by a new one, and its reservation is released in a later sample. Between samples a random pause of
 * 20-60 ms, so that the releases fall at every point of the waiters' pauses. Also counted: the scripts Redis ran
 * (EVALSHA in INFO commandstats) a sample, what handing an item over to a waiter costs Redis: the release, the try
 * that serves it, the new waiter's first try, every try in vain meanwhile, and the few sweeps of both services (only
 * the service measured has waiters then).
 *
 * `--behind`: a waiter behind a larger one, served by an item that comes free together with one free before. A waiter
 * for 100 (never served) is first in line, the WAITERS waiters behind it want 2 each, and each sample first releases
 * one item (nobody can be served: 1 free), then, 20-60 ms later, the one measured (2 free: the first waiter for 2 is
 * served; a free of 1 item alone wakes only the waiter for 100, whose try finds 2 free it cannot use). The waiters
 * served keep their items.
 *
 *   npm run bench:wait              # 3 rounds of 150 samples a service, about 1 minute
 *   npm run bench:wait -- --quick   # 1 round of 50
 *   npm run bench:wait -- --behind  # 3 rounds of 80 samples a service (a round stays within a waiter's 30 s)
 */
import { ChildProcess, spawn } from 'node:child_process';
import pg from 'pg';
import { Redis } from 'ioredis';
import { deleteKeys, freePort, serviceArgs } from '../test/support/services.js';
import { benchServiceEnv, client, waitHttp } from './load.js';

const QUICK = process.argv.includes('--quick');
const BEHIND = process.argv.includes('--behind');
const ROUNDS = QUICK ? 1 : 3;
const SAMPLES = QUICK ? 50 : BEHIND ? 80 : 150;
const WAITERS = 8;
/** How many items a waiter wants: 2 behind the waiter for BIG (--behind), else 1. */
const WANTS = BEHIND ? 2 : 1;
const BIG = 100;
const PG_ADMIN = 'postgres://postgres@127.0.0.1:5432/postgres';
const DB = 'respool_bench_wait';
const DB_URL = `postgres://postgres@127.0.0.1:5432/${DB}`;
const REDIS_URL = 'redis://127.0.0.1:6379';
const PREFIX = `benchwait${Date.now()}:`;

const say = (msg: string) => console.log(`[bench:wait ${new Date().toISOString().slice(11, 19)}] ${msg}`);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const percentile = (sorted: number[], p: number) => sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];

/** Redis' count of scripts run so far (EVALSHA calls). */
async function evalshaCalls(redis: Redis): Promise<number> {
  const stats = await redis.info('commandstats');
  return Number(/cmdstat_evalsha:calls=(\d+)/.exec(stats)?.[1] ?? 0);
}

interface Service {
  label: string;
  child: ChildProcess;
  pool: string;
  call: ReturnType<typeof client>['call'];
  /** Reservations of one item held now, to release one a sample. */
  held: string[];
  /** Waiters under way: their answers. */
  waiting: Set<Promise<{ status: number; body: { id?: string } }>>;
  latencies: number[];
  /** Scripts Redis ran a sample, each round. */
  scriptsPerSample: number[];
}

async function main(): Promise<void> {
  const admin = new pg.Client({ connectionString: PG_ADMIN });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
  const redis = new Redis(REDIS_URL);
  const children: ChildProcess[] = [];
  try {
    const services: Service[] = [];
    for (const [label, wakeUps] of [
      ['woken (WAIT_WAKE_UPS=true)', 'true'],
      ['trying again only (WAIT_WAKE_UPS=false)', 'false'],
    ] as const) {
      const port = await freePort();
      const child = spawn(process.execPath, serviceArgs(), {
        env: { ...process.env, ...benchServiceEnv(port, DB_URL, REDIS_URL, PREFIX), WAIT_WAKE_UPS: wakeUps },
        stdio: ['ignore', 'ignore', 'inherit'],
      });
      children.push(child);
      const url = `http://127.0.0.1:${port}`;
      await waitHttp(`${url}/health/live`);
      const { call } = client(url, WAITERS + 4);
      const pool = wakeUps === 'true' ? 'woken' : 'polling';
      // The first service creates the database; the second waits for its migrations (it started after).
      const created = await call('POST', '/v1/pools', { name: pool, kind: 'number', holdTtlMs: 600_000, maxHoldTtlMs: 600_000 });
      if (created.status !== 201) throw new Error(`pool ${pool}: ${created.status} ${JSON.stringify(created.body)}`);
      // --behind: 2 items a sample and 2 a waiter served at a round's end, kept by the waiters served.
      const items = Array.from({ length: BEHIND ? ROUNDS * (SAMPLES + WAITERS) * 2 + WAITERS : WAITERS * 2 }, (_, i) => ({
        value: `${pool}-${i}`,
      }));
      const imported = await call('POST', `/v1/pools/${pool}/resources`, { items });
      if (imported.status !== 201) throw new Error(`import ${pool}: ${imported.status}`);
      const held: string[] = [];
      for (let i = 0; i < items.length; i++) {
        const r = await call('POST', `/v1/pools/${pool}/reservations`, { owner: 'holder', count: 1 });
        if (r.status !== 201) throw new Error(`hold ${pool}: ${r.status}`);
        held.push((r.body as { id: string }).id);
      }
      services.push({ label, child, pool, call, held, waiting: new Set(), latencies: [], scriptsPerSample: [] });
    }

    const startWaiter = (s: Service) => {
      const answer = s.call('POST', `/v1/pools/${s.pool}/reservations`, { owner: 'waiter', count: WANTS, waitMs: 30_000 }) as Promise<{
        status: number;
        body: { id?: string };
      }>;
      const tracked = answer.then((r) => {
        s.waiting.delete(tracked);
        return r;
      });
      // A waiter cut off when the bench stops on an error (its service killed) must not end the process before the
      // clean-up below has run; the samples await `tracked` itself and see its failure there.
      tracked.catch(() => undefined);
      s.waiting.add(tracked);
    };

    for (let round = 1; round <= ROUNDS; round++) {
      // Each round in the other order, so that neither is always measured first.
      for (const s of round % 2 ? services : [...services].reverse()) {
        if (BEHIND) {
          // First in line (it waits 30 s, a round's length at most; one left from the round before is ahead of it).
          void s.call('POST', `/v1/pools/${s.pool}/reservations`, { owner: 'big', count: BIG, waitMs: 30_000 }).catch(() => undefined);
          await sleep(200);
        }
        while (s.waiting.size < WAITERS) startWaiter(s);
        await sleep(1_000); // the waiters' backoff reaches its longest pause
        const scriptsBefore = await evalshaCalls(redis);
        const started = Date.now();
        for (let i = 0; i < SAMPLES; i++) {
          if (BEHIND) {
            // 1 free: too few for any waiter.
            const first = await s.call('DELETE', `/v1/reservations/${s.held.shift()}`);
            if (first.status !== 200) throw new Error(`release: ${first.status}`);
          }
          await sleep(20 + Math.random() * 40);
          const at = performance.now();
          const released = await s.call('DELETE', `/v1/reservations/${s.held.shift()}`);
          if (released.status !== 200) throw new Error(`release: ${released.status}`);
          const served = await Promise.race(s.waiting);
          const latency = performance.now() - at;
          if (served.status !== 201 || !served.body.id) throw new Error(`waiter: ${served.status} ${JSON.stringify(served.body)}`);
          s.latencies.push(latency);
          if (!BEHIND) s.held.push(served.body.id);
          startWaiter(s);
        }
        const seconds = (Date.now() - started) / 1000;
        s.scriptsPerSample.push(((await evalshaCalls(redis)) - scriptsBefore) / SAMPLES);
        say(`round ${round}, ${s.label}: ${SAMPLES} samples in ${seconds.toFixed(1)} s`);
        // Every waiter served, so that only the next service's waiters run scripts while it is measured.
        while (s.waiting.size > 0) {
          for (let n = 0; n < WANTS; n++) {
            const released = await s.call('DELETE', `/v1/reservations/${s.held.shift()}`);
            if (released.status !== 200) throw new Error(`release: ${released.status}`);
          }
          const served = await Promise.race(s.waiting);
          if (served.status !== 201 || !served.body.id) throw new Error(`waiter: ${served.status}`);
          if (!BEHIND) s.held.push(served.body.id);
        }
      }
    }

    const rows = services.map((s) => {
      const sorted = [...s.latencies].sort((a, b) => a - b);
      const scripts = [...s.scriptsPerSample].sort((a, b) => a - b)[Math.floor(s.scriptsPerSample.length / 2)];
      return { s, p50: percentile(sorted, 50), p90: percentile(sorted, 90), p99: percentile(sorted, 99), scripts };
    });
    const [woken, polling] = rows;
    console.log(
      BEHIND
        ? `\nA waiter's wait for 2 items, one free before and one that comes free, behind a waiter for ${BIG} (${ROUNDS * SAMPLES} samples each, ${WAITERS} waiters)\n`
        : `\nA waiter's wait for an item that comes free (${ROUNDS * SAMPLES} samples each, ${WAITERS} waiters)\n`,
    );
    console.log(
      `| service | p50 ms | p90 ms | p99 ms | Redis scripts ${BEHIND ? 'a waiter served' : 'an item handed over'} (median of rounds) |`,
    );
    console.log('| --- | ---: | ---: | ---: | ---: |');
    for (const r of rows) {
      console.log(`| ${r.s.label} | ${r.p50.toFixed(1)} | ${r.p90.toFixed(1)} | ${r.p99.toFixed(1)} | ${r.scripts.toFixed(1)} |`);
    }
    console.log(
      `\nwoken / trying again only: p50 ${(woken.p50 / polling.p50).toFixed(2)}×, p99 ${(woken.p99 / polling.p99).toFixed(2)}×, ` +
        `scripts an item ${(woken.scripts / polling.scripts).toFixed(2)}×`,
    );
  } finally {
    for (const child of children) child.kill('SIGTERM');
    await Promise.all(children.map((c) => new Promise((r) => (c.exitCode === null ? c.once('exit', r) : r(null)))));
    await deleteKeys(REDIS_URL, PREFIX);
    redis.disconnect();
    await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
    await admin.end();
  }
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});
