/**
 * `npm run bench:redis-ir [-- <ops>] [--annotate]`: how many CPU instructions Redis executes for each hot-path operation of
 * respool, counted by valgrind's callgrind on a Redis server of this script's own.
 *
 * A count of instructions, not a time: it does not move with what else the machine runs (this one is shared,
 * and its timings drift by tens of per cent within minutes), so two versions of the scripts are compared by
 * running this once on each (another checkout, or `git stash`) and dividing. Each operation goes through
 * HoldStore as the service sends it, one at a time (no pipelining, so the figures do not depend on timing);
 * what Redis' own code, its Lua interpreter and its allocator execute counts, the kernel's work for the
 * socket does not. Instructions are not time: a cache miss costs more than an instruction, which makes this
 * a guide for Lua and command counts, while `npm run bench` judges.
 *
 * Flows, on one 20,000-item pool of phone numbers (no attributes), `ops` of each (default 400):
 * - reserve 3: the reserve script;
 * - confirm 1 of 3: pin, and finish (the two Redis steps of a confirm; Postgres is not involved);
 * - expiry of a reserve 3: the sweeps that expire them, per reservation (batches as the sweeper sends them);
 * - release of a reserve 3: DELETE's script;
 * - and, for scale, an EVALSHA that returns at once, and one of the whole shared prelude (_lib.lua; each script
 *   carries only the helpers of it that it uses).
 * Needs valgrind (Debian's package). With --annotate, each flow's functions by instructions (callgrind_annotate):
 * Debian's redis-server has no symbols, so put a build of the same version with them first on the PATH (the
 * server is the first redis-server found there); IR_INCLUSIVE=1 lists inclusive counts instead of self counts.
 * It deletes its server's data when done.
 */
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { AppConfig } from '../src/config/app-config.js';
import type { CachedItem, HoldStore as HoldStoreClass } from '../src/redis/hold-store.repository.js';
import { MAX_BATCHES_PER_TICK, SWEEP_BATCH, SWEEP_WORK_BUDGET } from '../src/sweeper/sweep-limits.js';
import { OwnRedis } from '../test/support/services.js';

// The service's build (nest build, with the .lua files beside it), not this folder's copy of its sources.
const { HoldStore } = (await import(new URL('../../src/redis/hold-store.repository.js', import.meta.url).href)) as {
  HoldStore: typeof HoldStoreClass;
};
const annotate = process.argv.includes('--annotate');
const OPS = Number(process.argv.slice(2).find((a) => !a.startsWith('--')) ?? 400);
const POOL_SIZE = 20_000;
const POOL = 'ir';
const say = (msg: string) => console.log(`[bench:redis-ir ${new Date().toISOString().slice(11, 19)}] ${msg}`);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const dir = mkdtempSync(join(tmpdir(), 'respool-ir-'));
// Counting starts switched off (the pool's import is not counted); valgrind takes seconds to start the server.
const server = await OwnRedis.start(
  [],
  ['valgrind', '--tool=callgrind', '--instr-atstart=no', `--callgrind-out-file=${join(dir, 'cg.out')}`],
  120_000,
);

const control = (...args: string[]) =>
  execFileSync('callgrind_control', [...args, String(server.pid)], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

/** Instructions executed by the server while `work` ran. */
async function instructions(work: () => Promise<void>): Promise<number> {
  control('-i', 'on');
  control('-z');
  await work();
  control('-d');
  control('-i', 'off');
  const dumps = readdirSync(dir)
    .filter((f) => f.startsWith('cg.out'))
    .map((f) => join(dir, f));
  const latest = dumps.sort((a, b) => Number(/\.(\d+)$/.exec(a)?.[1] ?? 0) - Number(/\.(\d+)$/.exec(b)?.[1] ?? 0)).at(-1)!;
  const totals = /^(?:summary|totals):\s+(\d+)/m.exec(readFileSync(latest, 'utf8'));
  if (!totals) throw new Error(`no totals in ${latest}`);
  if (annotate)
    console.log(
      execFileSync('callgrind_annotate', [process.env.IR_INCLUSIVE ? '--inclusive=yes' : '--inclusive=no', latest], { encoding: 'utf8' })
        .split('\n')
        .slice(0, 60)
        .join('\n'),
    );
  for (const f of dumps) rmSync(f);
  return Number(totals[1]);
}

const config = Object.assign(new AppConfig(), { REDIS_KEY_PREFIX: 'ir:', REDIS_TIMEOUT_MS: 120_000, HOLD_GRACE_MS: 0 });
const redis = new Redis(server.url, { maxRetriesPerRequest: null });
try {
  const holds = new HoldStore(redis, config);
  say(`Redis under callgrind on port ${server.port}; ${POOL_SIZE} items`);
  await holds.setGeneration(POOL, 1, 'always');
  const items: CachedItem[] = Array.from({ length: POOL_SIZE }, (_, i) => ({
    id: String(1_000_000 + i),
    v: `+8613${String(i).padStart(9, '0')}`,
    n: 0,
  }));
  await holds.addFree(POOL, 1, await holds.clock(), items);

  let made = 0;
  const reserve = async (ttlMs: number) => {
    const r = await holds.reserve(POOL, {
      reservationId: `ir.${made++}`,
      owner: `owner-${made % 50}`,
      count: 3,
      ttlMs,
      maxHoldsPerOwner: 0,
      kind: 'r',
      groupAffinity: false,
    });
    if (r.status !== 'ok') throw new Error(`reserve: ${r.status}`);
    return r.reservation;
  };
  const results: [string, number][] = [];
  const measure = async (label: string, work: () => Promise<void>) => {
    const ir = await instructions(work);
    results.push([label, ir / OPS]);
    say(`${label}: ${(ir / OPS).toFixed(0)} instructions an operation`);
  };

  const kept: Awaited<ReturnType<typeof reserve>>[] = [];
  await measure('reserve 3', async () => {
    for (let i = 0; i < OPS; i++) kept.push(await reserve(600_000));
  });
  const pinned: typeof kept = [];
  await measure("confirm 1 of 3: pin (the confirm's first script)", async () => {
    for (const r of kept) {
      const pin = await holds.pin(POOL, r.id, [r.items[0].id], config.COMMIT_WINDOW_MS);
      if (pin.status !== 'pinned') throw new Error(`pin: ${pin.status}`);
      pinned.push(pin.reservation);
    }
  });
  await measure('confirm 1 of 3: finish (its last script, after the commit)', async () => {
    for (const r of pinned) {
      const chosen = r.items[0];
      await holds.finish(POOL, r.id, [{ resourceId: chosen.id, value: chosen.v, version: chosen.n + 1 }], '{}');
    }
  });
  const toRelease: string[] = [];
  for (let i = 0; i < OPS; i++) toRelease.push((await reserve(600_000)).id);
  await measure('release of a reserve 3', async () => {
    for (const id of toRelease) {
      const released = await holds.release(POOL, id);
      if (released.status !== 'released') throw new Error(`release: ${released.status}`);
    }
  });
  for (let i = 0; i < OPS; i++) await reserve(1000);
  await sleep(1500);
  await measure('expiry of a reserve 3 (sweeps)', async () => {
    let expired = 0;
    for (let batch = 0; batch < MAX_BATCHES_PER_TICK && expired < OPS; batch++) {
      const swept = await holds.sweep(POOL, SWEEP_BATCH, config.COMMIT_WINDOW_MS, SWEEP_WORK_BUDGET);
      expired += swept.expiredReservations;
      if (!swept.more) break;
    }
    if (expired !== OPS) throw new Error(`swept ${expired} of ${OPS}`);
  });

  // What every script pays before its own work: an EVALSHA that returns at once; and, for scale, one that first runs
  // the whole shared prelude (_lib.lua), of which each script of src/redis/scripts carries the helpers it uses.
  const lib = readFileSync(new URL('../../src/redis/scripts/_lib.lua', import.meta.url), 'utf8');
  redis.defineCommand('ir_empty', { numberOfKeys: 1, lua: 'return 1' });
  redis.defineCommand('ir_prelude', { numberOfKeys: 1, lua: `${lib}\nreturn 1` });
  const calibration = redis as unknown as Record<'ir_empty' | 'ir_prelude', (key: string) => Promise<number>>;
  await calibration.ir_empty('k');
  await calibration.ir_prelude('k');
  await measure('an EVALSHA that returns at once', async () => {
    for (let i = 0; i < OPS; i++) await calibration.ir_empty('k');
  });
  await measure('an EVALSHA of the whole shared prelude alone', async () => {
    for (let i = 0; i < OPS; i++) await calibration.ir_prelude('k');
  });

  console.log(`\nRedis instructions an operation (callgrind, ${OPS} operations each, one at a time)\n`);
  console.log('| operation | instructions |\n| --- | ---: |');
  for (const [label, per] of results) console.log(`| ${label} | ${per.toFixed(0)} |`);
} finally {
  redis.disconnect();
  await server.stop();
  rmSync(dir, { recursive: true, force: true });
}
