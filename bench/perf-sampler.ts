/**
 * Linux `perf` for bench/profile.ts (`--perf`): CPU samples of every process of the machine at once, on
 * the CPU clock. V8's own profiler samples the service's main thread by the wall clock: a socket write
 * that wakes its receiver, or a wait for a lock in the kernel, counts there as long as the thread is off
 * the CPU, and the other processes' share is not seen at all. These samples count CPU time only, and
 * split it by process, and the service's part by what ran (garbage collection, kernel, JavaScript, ...)
 * and by the package whose JavaScript led to it. The service runs with --perf-basic-prof, so that perf
 * can name its JIT-compiled functions.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';

/** perf's sampling rate per CPU: a sample stands for 1/FREQUENCY s of CPU time. */
const FREQUENCY = 999;

export interface PerfRecording {
  /** Stops the recording; resolves once perf has written its file. */
  stop(): Promise<void>;
}

/** Throws with what to install when perf is not there. */
export function assertPerf(): void {
  if (spawnSync('perf', ['--version']).status !== 0) {
    throw new Error('--perf needs Linux perf: apt-get install -y linux-perf (and to run as root)');
  }
}

/** Records CPU samples with call stacks of every process into `file`, until stopped. */
export function recordPerf(file: string): PerfRecording {
  const perf = spawn('perf', ['record', '-e', 'cpu-clock', '-F', String(FREQUENCY), '-a', '-g', '-o', file, '-q'], {
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  const exited = new Promise<void>((resolve) => perf.once('exit', () => resolve()));
  return {
    stop: () => {
      perf.kill('SIGINT');
      return exited;
    },
  };
}

export interface Sample {
  pid: number;
  comm: string;
  /** Symbols, the sampled one first, then its callers. */
  stack: string[];
  /** The sampled function is the kernel's. */
  kernel: boolean;
}

/** The samples in `perf script -F comm,pid,tid,ip,sym,dso` output (with call stacks). */
export function parseSamples(text: string): Sample[] {
  const out: Sample[] = [];
  for (const block of text.split('\n\n')) {
    const [head, ...frames] = block.split('\n').filter((line) => line.trim() !== '');
    const m = head ? /^(.*\S)\s+(\d+)\/\d+\s*$/.exec(head) : null;
    if (!m) continue;
    // A frame: "<address> <symbol> (<file it is in>)".
    const stack = frames.map((f) => f.trim().replace(/^[0-9a-f]+\s+/, ''));
    out.push({
      comm: m[1],
      pid: Number(m[2]),
      stack: stack.map((f) => f.replace(/\s+\([^()]*\)$/, '')),
      kernel: /\(\[kernel/.test(stack[0] ?? ''),
    });
  }
  return out;
}

/** What a sample of the service was doing, by the function sampled. */
function kindOf({ stack, kernel }: Sample): string {
  const leaf = stack[0] ?? '';
  if (stack.some((f) => /Scavenge|ConcurrentMarking|MarkCompact|Sweeper|MarkingVisitor|IncrementalMarking|GCTracer/.test(f))) {
    return 'garbage collection';
  }
  if (kernel) return 'kernel';
  if (/\[unknown\]$/.test(leaf) || leaf === '') return 'unknown';
  if (/^JS:/.test(leaf)) return 'JavaScript (compiled)';
  if (/^(Builtins_|Builtin:)/.test(leaf)) return 'V8 built-ins';
  if (/Json|StringTable|String::|StringAdd/.test(leaf)) return 'V8 strings and JSON';
  if (/^(v8::|Runtime_)/.test(leaf)) return 'V8, other';
  if (/^(node::|uv_|uv__|llhttp)/.test(leaf)) return 'Node and libuv';
  if (/^(__)?(malloc|free|cfree|realloc|_int_|mem(cpy|move|set|cmp)|unlink_chunk)/.test(leaf)) return 'C library memory';
  return 'other native';
}

/** The package whose JavaScript is nearest the sampled function, or respool's file. */
function ownerOf(stack: string[]): string {
  for (const frame of stack) {
    if (!frame.startsWith('JS:')) continue;
    const pkg = /node_modules\/((@[^/]+\/)?[^/:\s]+)/.exec(frame);
    if (pkg) return pkg[1];
    const own = /\/dist\/src\/([^:\s]+)/.exec(frame);
    if (own) return `respool ${own[1]}`;
  }
  return stack.some((f) => f.startsWith('JS:')) ? 'node core' : '(no JavaScript on the stack)';
}

/** `summariseSamples` of a perf recording. */
export function summarisePerf(file: string, servicePid: number, loadPid: number, ops: number, top = 20): string {
  const text = execFileSync('perf', ['script', '-i', file, '-F', 'comm,pid,tid,ip,sym,dso'], {
    maxBuffer: 1 << 30,
    encoding: 'utf8',
    stdio: ['ignore', 'pipe', 'ignore'],
  });
  return summariseSamples(parseSamples(text), servicePid, loadPid, ops, top);
}

/**
 * CPU time per operation by process (the service, Redis, Postgres, the load generator, idle, the rest),
 * then the service's by kind and by package. `loadPid`: the process generating the load.
 */
export function summariseSamples(all: Sample[], servicePid: number, loadPid: number, ops: number, top = 20): string {
  const us = (n: number) => `${((n * 1e6) / FREQUENCY / ops).toFixed(1).padStart(7)} µs`;
  const count = (m: Map<string, number>, key: string) => m.set(key, (m.get(key) ?? 0) + 1);
  const byProcess = new Map<string, number>();
  const byKind = new Map<string, number>();
  const byOwner = new Map<string, number>();
  for (const s of all) {
    const group =
      s.pid === servicePid
        ? 'service'
        : s.pid === loadPid
          ? 'load generator'
          : s.pid === 0
            ? 'idle'
            : s.comm === 'redis-server'
              ? 'redis'
              : s.comm === 'postgres'
                ? 'postgres'
                : 'other processes';
    count(byProcess, group);
    if (group !== 'service') continue;
    count(byKind, kindOf(s));
    count(byOwner, ownerOf(s.stack));
  }
  const list = (m: Map<string, number>, n = top) =>
    [...m]
      .sort((a, b) => b[1] - a[1])
      .slice(0, n)
      .map(([name, k]) => `${us(k)}  ${name}`)
      .join('\n');
  return [
    `perf: CPU time per operation (${all.length} samples at ${FREQUENCY} Hz a CPU, ${ops} operations)`,
    `--- by process\n${list(byProcess)}`,
    `--- the service, by what ran\n${list(byKind)}`,
    `--- the service, by the package whose JavaScript led to it\n${list(byOwner)}`,
  ].join('\n');
}
