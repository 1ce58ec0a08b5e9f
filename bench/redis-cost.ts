/**
 * `npm run bench:redis [-- 1000,100000,1000000] [--baseline <scripts folder>]`: what Redis itself spends on
 * respool's scripts, by pool size.
 *
 * The growth target asks reserve latency to stay flat from 1,000 to 1,000,000 items. Redis is where pool
 * size can show (the service does the same work whatever the size), so this measures Redis alone, with
 * no HTTP, no service and no network in the figures, on pools laid out exactly as respool lays them out
 * (imported through its own add_free script, as HoldStore.addFree imports them):
 *
 * 1. the commands of the reserve and release scripts that touch the pool's data, each timed inside one
 *    Lua script (Redis' TIME around a loop of 50,000 calls on random items), less the loop's own cost
 *    (the same loop with no call); the median of 5 rounds, sizes and commands in turn;
 * 2. the reserve (count 1) and release scripts themselves, as respool runs them: Redis' own time for
 *    EVALSHA (`INFO commandstats`) per reserve + release pair, 100 pairs in flight, sizes in turn
 *    round after round so the machine's drift falls on each alike; the median of 5 rounds;
 * 3. the same pair with no EVALSHA and no network: the scripts' bodies run back to back inside one script
 *    (each body a Lua function of its ARGV, after the shared library), a steadier figure than 2;
 * 4. on the largest pool, three flows run the same way inside one script: reserve 1 + release; reserve 3
 *    + confirm 1 (pin, finish); reserve 3 with a 1 ms hold + its expiry (a sweep every 100 reserves).
 *    With --baseline, the same flows with the scripts of another folder (another checkout's
 *    src/redis/scripts), in turn round after round, and the ratio: a change to the scripts measured
 *    against what it changed, in one run.
 *
 * It uses its own key prefix and deletes its keys at the end.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { randomUUID } from 'node:crypto';
import { Redis } from 'ioredis';
import { poolKeys } from '../src/redis/keys.js';
import { loadScript } from '../src/redis/lua-prelude.js';
import { redisNowMs } from '../src/redis/redis.client.js';
import { deleteKeys } from '../test/support/services.js';
import { medianOf } from './load.js';
import { READ_MAX_AGE_MS, type CachedItem } from '../src/redis/hold-store.repository.js';
import { AppConfig } from '../src/config/app-config.js';
import { SWEEP_BATCH, SWEEP_WORK_BUDGET } from '../src/sweeper/sweep-limits.js';

const args = process.argv.slice(2);
const baselineAt = args.indexOf('--baseline');
const baselineDir = baselineAt >= 0 ? args.splice(baselineAt, 2)[1] : undefined;
const sizes = (args[0] ?? '1000,100000,1000000').split(',').map(Number);
const PREFIX = `rediscost${Date.now()}:`;
const LOOP = 50_000;
const ROUNDS = 5;
const PAIRS = 20_000;
/** Operations a flow's loop runs inside one script (part 4). */
const FLOW_OPS = 5_000;
const IN_FLIGHT = 100;

const REDIS_URL = process.env.REDIS_URL ?? 'redis://127.0.0.1:6379';
const redis = new Redis(REDIS_URL, { enableAutoPipelining: true });
const scripts = fileURLToPath(new URL('../../src/redis/scripts/', import.meta.url));
const readScript = (dir: string, name: string) => readFileSync(join(dir, `${name}.lua`), 'utf8');
for (const name of ['reserve', 'release', 'add_free']) {
  redis.defineCommand(`rp_${name}`, { numberOfKeys: 1, lua: loadScript(pathToFileURL(scripts + '/'), name) });
}
const call = redis as unknown as Record<string, (...args: unknown[]) => Promise<string[]>>;

const say = (msg: string) => console.log(`[bench:redis ${new Date().toISOString().slice(11, 19)}] ${msg}`);

/** Item i of a pool: ids and values shaped like respool's (bigint ids, phone-number values). */
const idOf = (i: number) => String(1_000_000 + i);
const valueOf = (i: number) => `+8613${String(i).padStart(9, '0')}`;

async function usedMemory(): Promise<number> {
  return Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
}

/**
 * Imports `size` free items as respool does (its add_free script, 500 items a call, as HoldStore.addFree
 * sends them, in generation 1); returns Redis memory per item.
 */
async function populate(pool: string, size: number): Promise<number> {
  const keys = poolKeys(PREFIX, pool);
  const before = await usedMemory();
  await redis.set(keys.generation, '1');
  for (let i = 0; i < size; i += 500) {
    const items: CachedItem[] = [];
    for (let j = i; j < Math.min(size, i + 500); j++) items.push({ id: idOf(j), v: valueOf(j), n: 0 });
    // The script's age fence: a read stamped by Redis' clock now.
    await call.rp_add_free(keys.free, keys.base, 1, await redisNowMs(redis), READ_MAX_AGE_MS, ...items.map((item) => JSON.stringify(item)));
  }
  return ((await usedMemory()) - before) / size;
}

/**
 * One command on random items, LOOP times, inside one script; µs a call. The item is rebuilt in Lua as
 * populate() built it (the same id, value and bucket rule as _lib.lua's item_key).
 */
const COMMAND_LOOP = `
local base, op, size, loops = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local free = base .. 'free'
local t0 = redis.call('TIME')
for _ = 1, loops do
  local i = math.random(0, size - 1)
  local id = tostring(1000000 + i)
  local m = string.format('+8613%09d', i) .. '\\0' .. id
  local bucket = base .. 'item:' .. string.sub(id, 1, -3)
  if op == 'ZRANDMEMBER' then redis.call('ZRANDMEMBER', free, 1)
  elseif op == 'ZSCORE' then redis.call('ZSCORE', free, m)
  elseif op == 'ZREM + ZADD' then redis.call('ZREM', free, m); redis.call('ZADD', free, 0, m)
  elseif op == 'HGET item' then redis.call('HGET', bucket, id)
  elseif op == 'EXISTS hold' then redis.call('EXISTS', base .. 'h:' .. id)
  end
end
local t1 = redis.call('TIME')
return tostring(((t1[1] - t0[1]) * 1e6 + (t1[2] - t0[2])) / loops)`;
const COMMANDS = ['ZRANDMEMBER', 'ZSCORE', 'ZREM + ZADD', 'HGET item', 'EXISTS hold'];

async function commandCost(pool: string, size: number, op: string): Promise<number> {
  return Number(await redis.eval(COMMAND_LOOP, 0, poolKeys(PREFIX, pool).base, op, size, LOOP));
}

async function evalshaUsec(): Promise<number> {
  const m = /cmdstat_evalsha:calls=\d+,usec=(\d+)/.exec(await redis.info('commandstats'));
  return m ? Number(m[1]) : 0;
}

/** Redis' time in EVALSHA per reserve (count 1) + release pair, PAIRS pairs with IN_FLIGHT in flight. */
async function pairCost(pool: string): Promise<number> {
  const keys = poolKeys(PREFIX, pool);
  const grace = new AppConfig().HOLD_GRACE_MS;
  let started = 0;
  const before = await evalshaUsec();
  await Promise.all(
    Array.from({ length: IN_FLIGHT }, async () => {
      while (started++ < PAIRS) {
        const rid = `${pool}.${randomUUID()}`;
        const held = await call.rp_reserve(keys.free, keys.base, rid, 'bench', 1, 1000, 0, 'r', 60_000, '', '', 0, '', '', '0', grace, '', 0);
        if (held[0] !== 'ok') throw new Error(`reserve on ${pool}: ${held.join(' ')}`);
        const released = await call.rp_release(keys.free, keys.base, rid, 60_000, '');
        if (released[0] !== 'released') throw new Error(`release on ${pool}: ${released.join(' ')}`);
      }
    }),
  );
  return ((await evalshaUsec()) - before) / PAIRS;
}

type Flow = 'reserve 1 + release' | 'reserve 3 + confirm 1' | 'reserve 3 + expiry';
const FLOWS: Flow[] = ['reserve 1 + release', 'reserve 3 + confirm 1', 'reserve 3 + expiry'];

/**
 * A flow run `ops` times inside one script, with the scripts of folder `dir`: each script's body becomes a
 * Lua function of its ARGV, after the shared library, called with the arguments respool gives it. µs an op.
 */
function flowLoop(dir: string): string {
  const body = (name: string) => `local function ${name}_body(ARGV)\n${readScript(dir, name)}\nend`;
  return `${readScript(dir, '_lib')}
${['reserve', 'release', 'pin', 'finish', 'sweep'].map(body).join('\n')}
local base, tag, ops, flow, grace = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local function reserve(rid, count, ttl, hold_grace)
  local held = reserve_body({ base, rid, 'bench', count, ttl, '0', 'r', '60000', '', '', '0', '', '', '0', hold_grace })
  if held[1] ~= 'ok' then error('reserve: ' .. tostring(held[1])) end
  return held
end
local t0 = redis.call('TIME')
for i = 1, ops do
  local rid = tag .. i
  if flow == 'reserve 1 + release' then
    reserve(rid, '1', '1000', grace)
    local released = release_body({ base, rid, '60000', '' })
    if released[1] ~= 'released' then error('release: ' .. tostring(released[1])) end
  elseif flow == 'reserve 3 + confirm 1' then
    local item = cjson.decode(reserve(rid, '3', '60000', grace)[8])[1]
    local pinned = pin_body({ base, rid, '15000', item.id, grace, '' })
    if pinned[1] ~= 'pinned' then error('pin: ' .. tostring(pinned[1])) end
    finish_body({ base, rid, item.id, '{}', '60000', '60000', item.v .. '\\0' .. item.id, tostring(item.n + 1) })
  else
    reserve(rid, '3', '1', '0')
    if i % 100 == 0 then sweep_body({ base, '${SWEEP_BATCH}', '60000', '15000', '${SWEEP_WORK_BUDGET}' }) end
  end
end
local t1 = redis.call('TIME')
return tostring(((t1[1] - t0[1]) * 1e6 + (t1[2] - t0[2])) / ops)`;
}

let flowRuns = 0;
async function flowCost(dir: string, pool: string, flow: Flow, ops: number): Promise<number> {
  const grace = String(new AppConfig().HOLD_GRACE_MS);
  const tag = `${pool}.flow${flowRuns++}.`;
  return Number(await redis.eval(flowLoop(dir), 0, poolKeys(PREFIX, pool).base, tag, ops, flow, grace));
}

function row(cells: (string | number)[]): string {
  return `| ${cells.join(' | ')} |`;
}

async function main(): Promise<void> {
  const pools = sizes.map((size) => ({ size, pool: `p${size}` }));
  for (const { size, pool } of pools) say(`pool of ${size}: ${(await populate(pool, size)).toFixed(0)} bytes of Redis memory an item`);

  // Each command's figure: the median of ROUNDS loops, sizes and commands in turn, less the loop alone.
  const loops: Record<string, number[][]> = {};
  for (let round = 0; round < ROUNDS; round++) {
    for (const op of ['none', ...COMMANDS]) {
      loops[op] ??= pools.map(() => []);
      for (const [i, { size, pool }] of pools.entries()) loops[op][i].push(await commandCost(pool, size, op));
    }
  }
  const cost = Object.fromEntries(COMMANDS.map((op) => [op, loops[op].map((xs, i) => medianOf(xs) - medianOf(loops.none[i]))]));

  const pairs: number[][] = pools.map(() => []);
  const inScript: number[][] = pools.map(() => []);
  for (let round = 0; round < ROUNDS; round++) {
    for (const [i, { pool }] of pools.entries()) pairs[i].push(await pairCost(pool));
    for (const [i, { pool }] of pools.entries()) inScript[i].push(await flowCost(scripts, pool, 'reserve 1 + release', PAIRS));
    const show = (xs: number[][]) => pools.map(({ size }, i) => `${size}: ${xs[i][round].toFixed(1)} µs`).join(', ');
    say(`round ${round + 1}/${ROUNDS}: EVALSHA pairs ${show(pairs)}; in one script ${show(inScript)}`);
  }

  const signed = (x: number, digits: number) => `${x < 0 ? '−' : '+'}${Math.abs(x).toFixed(digits)}`;
  const growth = (xs: number[]) => `${signed(xs[xs.length - 1] - xs[0], 2)} µs (${signed((xs[xs.length - 1] / xs[0] - 1) * 100, 0)} %)`;
  const lines = [
    row([
      'Redis time, µs',
      ...pools.map(({ size }) => `${size.toLocaleString('en-US')} items`),
      `${sizes[0].toLocaleString('en-US')} → ${sizes[sizes.length - 1].toLocaleString('en-US')}`,
    ]),
    row(['---', ...pools.map(() => '---:'), '---:']),
    ...COMMANDS.map((op) => row([`${op}, a call`, ...cost[op].map((x) => x.toFixed(2)), growth(cost[op])])),
    row([
      'reserve (count 1) + release scripts, a pair, EVALSHA (median)',
      ...pairs.map((xs) => medianOf(xs).toFixed(1)),
      growth(pairs.map(medianOf)),
    ]),
    row([
      'the same two scripts run inside one script, a pair (median)',
      ...inScript.map((xs) => medianOf(xs).toFixed(1)),
      growth(inScript.map(medianOf)),
    ]),
  ];
  console.log(
    `\nRedis ${/redis_version:(\S+)/.exec(await redis.info('server'))![1]}; commands: median of ${ROUNDS} loops of ${LOOP.toLocaleString('en-US')} calls inside one script, less the loop alone; pairs: ${PAIRS.toLocaleString('en-US')} a round, ${IN_FLIGHT} in flight, ${ROUNDS} rounds\n`,
  );
  console.log(lines.join('\n'));

  // Part 4: the flows on the largest pool, these scripts and the baseline's in turn, round after round.
  const largest = pools[pools.length - 1];
  const folders = baselineDir ? [scripts, baselineDir] : [scripts];
  const flows = FLOWS.map((flow) => ({ flow, runs: folders.map(() => [] as number[]) }));
  // Each confirm allocates an item for good: a small pool gets fewer operations a loop, so half of it stays free.
  const ops = Math.min(FLOW_OPS, Math.floor(largest.size / (2 * ROUNDS * folders.length)));
  for (let round = 0; round < ROUNDS; round++) {
    for (const { flow, runs } of flows) {
      // Which folder goes first alternates, so neither always runs on the other's leftovers.
      const order = round % 2 ? [...folders.keys()].reverse() : [...folders.keys()];
      for (const f of order) runs[f].push(await flowCost(folders[f], largest.pool, flow, ops));
    }
  }
  console.log(
    `\nFlows inside one script on the ${largest.size.toLocaleString('en-US')}-item pool, µs an operation: median of ${ROUNDS} loops of ${ops.toLocaleString('en-US')}${baselineDir ? `; baseline: ${baselineDir}` : ''}\n`,
  );
  const header = baselineDir ? ['flow', 'these scripts', 'baseline', 'these / baseline'] : ['flow', 'these scripts'];
  console.log(
    [
      row(header),
      row(header.map((_, i) => (i === 0 ? '---' : '---:'))),
      ...flows.map(({ flow, runs }) => {
        const [mine, base] = runs.map(medianOf);
        return row(
          baselineDir ? [flow, mine.toFixed(1), base.toFixed(1), `${((mine / base) * 100).toFixed(0)} %`] : [flow, mine.toFixed(1)],
        );
      }),
    ].join('\n'),
  );
}

main()
  .catch((err) => {
    console.error(err);
    process.exitCode = 1;
  })
  .finally(async () => {
    await deleteKeys(REDIS_URL, PREFIX);
    redis.disconnect();
  });
