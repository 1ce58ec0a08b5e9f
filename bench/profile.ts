/**
 * CPU profile of the service under one scenario of the benchmark, to see where the time goes before
 * changing anything. Starts respool with `node --cpu-prof`, drives the scenario, stops the service
 * (the profile is written on exit) and prints, for the timed run alone (not the set-up before it): self time
 * by package and by function, the service's read and write system calls per operation, and Redis' CPU and
 * time by command per operation. With `--heap`, the service runs under V8's sampling heap profiler instead
 * (bench/heap-sampler.ts) and the report gives the bytes allocated per operation, by package and by function.
 * With `--perf`, Linux perf samples the CPU time of every process of the machine instead (bench/perf-sampler.ts):
 * per operation, by process, and the service's by what ran and by package.
 *
 *   npm run bench:profile -- reserve|confirm|cycle|tasks|import [seconds] [--heap | --perf]
 *
 * `import` sends chunks of 10,000 new numbers one request at a time, as the bench's import of 1,000,000 does;
 * the others run at 100 connections.
 *
 * The .cpuprofile, .heapprofile or perf.data is left in /tmp/respool-profile-* (Chrome DevTools opens the first
 * two; `perf report -i` the last).
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Redis } from 'ioredis';
import pg from 'pg';
import { deleteKeys, freePort, serviceArgs } from '../test/support/services.js';
import { client, runLoad } from './load.js';
import { PerfRecording, assertPerf, recordPerf, summarisePerf } from './perf-sampler.js';

const heap = process.argv.includes('--heap');
const perf = process.argv.includes('--perf');
const [scenario = 'reserve', secondsArg = '10'] = process.argv.slice(2).filter((a) => a !== '--heap' && a !== '--perf');
const seconds = Number(secondsArg);
if (heap && perf) throw new Error('--heap or --perf, not both');
if (perf) assertPerf();
const DB = 'respool_profile';
const IMPORT_CHUNK = 10_000;
const PREFIX = `profile${Date.now()}:`;

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
}

/**
 * Self time by package (or respool / node core) and by function, in per cent of the samples; only the
 * samples taken within `window` (µs on the monotonic clock, which every process of the machine shares).
 */
export function summarise(file: string, top = 30, window?: { fromUs: number; toUs: number }): string {
  const profile = JSON.parse(readFileSync(file, 'utf8')) as {
    nodes: ProfileNode[];
    samples: number[];
    timeDeltas: number[];
    startTime: number;
  };
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const self = new Map<number, number>();
  let at = profile.startTime;
  profile.samples.forEach((id, i) => {
    const delta = profile.timeDeltas[i] ?? 0;
    at += delta;
    if (!window || (at >= window.fromUs && at <= window.toUs)) self.set(id, (self.get(id) ?? 0) + delta);
  });
  const total = [...self.values()].reduce((a, b) => a + b, 0);
  const { byPackage, byFunction } = tally([...self].map(([id, t]) => ({ frame: byId.get(id)!.callFrame, amount: t })));
  const list = (m: Map<string, number>) => ranked(m, top, total);
  return `${(total / 1e6).toFixed(1)} s of samples\n--- self time by package\n${list(byPackage)}\n--- self time by function\n${list(byFunction)}`;
}

interface HeapNode {
  callFrame: ProfileNode['callFrame'];
  selfSize: number;
  children: HeapNode[];
}

/** Bytes allocated per operation (sampled), by package and by function, from a sampling heap profile. */
export function summariseHeap(file: string, ops: number, top = 30): string {
  const head = (JSON.parse(readFileSync(file, 'utf8')) as { head: HeapNode }).head;
  const allocations: { frame: ProfileNode['callFrame']; amount: number }[] = [];
  const walk = (node: HeapNode) => {
    if (node.selfSize > 0) allocations.push({ frame: node.callFrame, amount: node.selfSize });
    node.children.forEach(walk);
  };
  walk(head);
  const total = allocations.reduce((sum, a) => sum + a.amount, 0);
  const { byPackage, byFunction } = tally(allocations);
  const list = (m: Map<string, number>) => ranked(m, top, total, (bytes) => `${(bytes / ops).toFixed(0).padStart(6)} B  `);
  return (
    `${(total / ops).toFixed(0)} bytes allocated per operation (${ops} operations)\n` +
    `--- by package (share, bytes per operation)\n${list(byPackage)}\n--- by function\n${list(byFunction)}`
  );
}

/** The `top` largest entries, largest first: each one's share of `total`, what `detail` says of it, its name. */
function ranked(m: Map<string, number>, top: number, total: number, detail: (amount: number) => string = () => ''): string {
  return [...m]
    .sort((a, b) => b[1] - a[1])
    .slice(0, top)
    .map(([name, amount]) => `${((amount / total) * 100).toFixed(1).padStart(5)} %  ${detail(amount)}${name}`)
    .join('\n');
}

/** Sums amounts by package (or respool / node core / a native function) and by function. */
function tally(entries: { frame: ProfileNode['callFrame']; amount: number }[]) {
  const byFunction = new Map<string, number>();
  const byPackage = new Map<string, number>();
  for (const { frame, amount } of entries) {
    const { functionName, url, lineNumber } = frame;
    const path = url.replace(/^file:\/\//, '');
    const fn = `${functionName || '(anonymous)'} ${path.split('/').slice(-2).join('/')}:${lineNumber + 1}`;
    byFunction.set(fn, (byFunction.get(fn) ?? 0) + amount);
    const nm = path.split('node_modules/').pop()!;
    const pkg = path.includes('node_modules/')
      ? nm
          .split('/')
          .slice(0, nm.startsWith('@') ? 2 : 1)
          .join('/')
      : path.startsWith('node:')
        ? 'node core'
        : path.includes('/dist/')
          ? 'respool'
          : functionName || '(native)';
    byPackage.set(pkg, (byPackage.get(pkg) ?? 0) + amount);
  }
  return { byPackage, byFunction };
}

interface Snapshot {
  atUs: number;
  syscalls: { read: number; write: number };
  redisCpuS: number;
  commands: Map<string, { calls: number; usec: number }>;
}

async function snapshot(redis: Redis, pid: number): Promise<Snapshot> {
  const atUs = Number(process.hrtime.bigint() / 1000n);
  const io = readFileSync(`/proc/${pid}/io`, 'utf8');
  const [cpu, stats] = await Promise.all([redis.info('cpu'), redis.info('commandstats')]);
  const field = (text: string, name: string) => Number(new RegExp(`${name}:\\s*([\\d.]+)`).exec(text)![1]);
  const commands = new Map<string, { calls: number; usec: number }>();
  for (const m of stats.matchAll(/^cmdstat_(\S+):calls=(\d+),usec=(\d+)/gm))
    commands.set(m[1], { calls: Number(m[2]), usec: Number(m[3]) });
  return {
    atUs,
    syscalls: { read: field(io, 'syscr'), write: field(io, 'syscw') },
    redisCpuS: field(cpu, 'used_cpu_user') + field(cpu, 'used_cpu_sys'),
    commands,
  };
}

/** Per operation of the timed run: the service's read and write system calls, Redis' CPU and its time by command. */
function costs(a: Snapshot, b: Snapshot, ops: number): string {
  const per = (n: number, digits = 1) => (n / ops).toFixed(digits);
  const lines = [
    `per operation (${ops} operations): service system calls: read ${per(b.syscalls.read - a.syscalls.read, 2)}, ` +
      `write ${per(b.syscalls.write - a.syscalls.write, 2)}; Redis CPU ${per((b.redisCpuS - a.redisCpuS) * 1e6)} µs`,
    'Redis commands per operation (calls from scripts counted as well as the scripts):',
  ];
  const rows = [...b.commands]
    .map(([name, s]) => ({ name, calls: s.calls - (a.commands.get(name)?.calls ?? 0), usec: s.usec - (a.commands.get(name)?.usec ?? 0) }))
    .filter((r) => r.calls > 0)
    .sort((x, y) => y.usec - x.usec);
  for (const r of rows) lines.push(`  ${r.name.padEnd(16)} ${per(r.calls, 2).padStart(6)} calls  ${per(r.usec).padStart(7)} µs`);
  return lines.join('\n');
}

async function main(): Promise<void> {
  const admin = new pg.Client({ connectionString: 'postgres://postgres@127.0.0.1:5432/postgres' });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
  const dir = mkdtempSync(join(tmpdir(), 'respool-profile-'));
  const port = await freePort();
  const heapFile = join(dir, 'service.heapprofile');
  const perfFile = join(dir, 'perf.data');
  const profiler = heap
    ? ['--import', fileURLToPath(new URL('./heap-sampler.js', import.meta.url))]
    : perf
      ? ['--perf-basic-prof']
      : ['--cpu-prof', '--cpu-prof-dir', dir];
  const service = spawn(process.execPath, [...profiler, ...serviceArgs()], {
    env: {
      ...process.env,
      RESPOOL_HEAP_PROFILE: heapFile,
      PORT: String(port),
      HOST: '127.0.0.1',
      DATABASE_URL: `postgres://postgres@127.0.0.1:5432/${DB}`,
      REDIS_URL: 'redis://127.0.0.1:6379',
      REDIS_KEY_PREFIX: PREFIX,
      LOG_LEVEL: 'warn',
      RECONCILE_INTERVAL_MS: '0',
    },
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; ; i++) {
    try {
      await fetch(`${url}/health/live`);
      break;
    } catch {
      if (i > 300) throw new Error('service did not start');
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  const { call, close } = client(url, 100);
  const kind = scenario === 'tasks' ? 'task' : 'number';
  await call('POST', '/v1/pools', { name: 'p', kind, holdTtlMs: 1000, maxHoldTtlMs: 600_000 });
  // confirm (below) needs reservations of 3 for up to 10,000 confirms a second, more than this machine has done.
  const reservationsNeeded = scenario === 'confirm' ? (seconds + 1) * 10_000 : 0;
  const poolSize = Math.max(100_000, Math.ceil((reservationsNeeded * 3 + 10_000) / 10_000) * 10_000);
  for (let i = 0; i < poolSize; i += 10_000) {
    const items = Array.from({ length: 10_000 }, (_, j) => ({ value: `p-${String(i + j).padStart(8, '0')}` }));
    await call('POST', '/v1/pools/p/resources', { items });
  }
  let imported = 0;
  const ops: Record<string, () => Promise<string>> = {
    reserve: async () => String((await call('POST', '/v1/pools/p/reservations', { owner: 'o', count: 3, ttlMs: 1000 })).status),
    confirm: async () => {
      const r = ready.pop();
      if (!r) return 'ran dry';
      return String((await call('POST', `/v1/reservations/${r.id}/confirm`, { resourceIds: [r.item] })).status);
    },
    cycle: async () => {
      const r = await call('POST', '/v1/pools/p/reservations', { owner: 'o', count: 3, ttlMs: 60_000 });
      if (r.status !== 201) return `reserve ${r.status}`;
      return String((await call('POST', `/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status);
    },
    import: async () => {
      const first = imported;
      imported += IMPORT_CHUNK;
      const items = Array.from({ length: IMPORT_CHUNK }, (_, j) => ({ value: `i-${String(first + j).padStart(9, '0')}` }));
      return String((await call('POST', '/v1/pools/p/resources', { items })).status);
    },
    tasks: async () => {
      const lease = await call('POST', '/v1/pools/p/tasks/next', { reviewer: 'r' });
      if (lease.status !== 200) return `pull ${lease.status}`;
      return String((await call('POST', `/v1/tasks/${lease.body.leaseId}/complete`)).status);
    },
  };
  // confirm: on reservations made before the profiled run, as the bench measures it.
  const ready: { id: string; item: string }[] = [];
  while (ready.length < reservationsNeeded) {
    await Promise.all(
      Array.from({ length: 100 }, async () => {
        const r = await call('POST', '/v1/pools/p/reservations', { owner: 'o', count: 3, ttlMs: 600_000 });
        if (r.status === 201) ready.push({ id: r.body.id, item: r.body.items[0].resourceId });
      }),
    );
  }
  // What the timed part of the run cost beside the profile: the service's system calls, and Redis' CPU
  // and command time. The first snapshot is taken when the load's warm-up ends (a timer of the same
  // length, set after the load's own, fires right after it). With --heap, SIGUSR2 starts and stops the
  // heap sampler at the same two moments; with --perf, perf records between them.
  const redis = new Redis('redis://127.0.0.1:6379');
  const load = runLoad(scenario === 'import' ? 1 : 100, seconds * 1000, ops[scenario]);
  let recording: PerfRecording | undefined;
  const before = new Promise<Snapshot>((resolve) =>
    setTimeout(() => {
      if (heap) service.kill('SIGUSR2');
      if (perf) recording = recordPerf(perfFile);
      resolve(snapshot(redis, service.pid!));
    }, 1000),
  );
  const result = await load;
  const after = await snapshot(redis, service.pid!);
  if (heap) service.kill('SIGUSR2');
  await recording?.stop();
  await redis.quit();
  const done = result.ops - (result.byStatus['ran dry'] ?? 0);
  console.log(costs(await before, after, done));
  console.log(
    `${scenario}: ${result.rps.toFixed(0)} ops/s, p50 ${result.p50.toFixed(2)} ms, p99 ${result.p99.toFixed(2)} ms ${JSON.stringify(result.byStatus)}`,
  );
  await close();
  for (let i = 0; heap && !existsSync(heapFile); i++) {
    if (i > 300) throw new Error('the heap sampler wrote no profile');
    await new Promise((r) => setTimeout(r, 100));
  }
  await new Promise<void>((resolve) => {
    service.once('exit', () => resolve());
    service.kill('SIGTERM');
  });
  if (heap) {
    console.log(`heap profile: ${heapFile} (the timed run only)\n${summariseHeap(heapFile, done)}`);
  } else if (perf) {
    console.log(`perf data: ${perfFile} (the timed run only)\n${summarisePerf(perfFile, service.pid!, process.pid, done)}`);
    rmSync(`/tmp/perf-${service.pid}.map`, { force: true }); // --perf-basic-prof's names of compiled functions
  } else {
    const file = join(
      dir,
      readdirSync(dir).find((f) => f.endsWith('.cpuprofile'))!,
    );
    const window = { fromUs: (await before).atUs, toUs: after.atUs };
    console.log(`profile: ${file} (the timed run only: ${window.fromUs}-${window.toUs} µs)\n${summarise(file, 30, window)}`);
  }
  await deleteKeys('redis://127.0.0.1:6379', PREFIX);
  await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
  await admin.end();
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);
