import { Pool } from 'undici';

export interface LoadResult {
  /** Completed operations per second (an operation may be several requests, see `op`). */
  rps: number;
  ops: number;
  durationMs: number;
  byStatus: Record<string, number>;
  /** Latency percentiles (ms) over all operations and by outcome. */
  p50: number;
  p99: number;
  latency: Record<string, { p50: number; p99: number }>;
  /** Every operation's latency (ms), when `runLoad` was asked to keep them. */
  samples?: number[];
  /** CPU µs per operation by process group over the timed part, when the wrk run was given a `CpuProbe`. */
  cpu?: Record<string, number>;
}

/** Names the process groups whose CPU a run reports per operation (see cpu.ts). */
export interface CpuProbe {
  groupOf: (pid: number, comm: string) => string | undefined;
  order: string[];
}

/**
 * respool's environment in a bench (as `npm run start:prod` runs it): on this port, database and key prefix, logging
 * warnings only and no request lines (the defaults, `info` and `true`, write one JSON line a request), and no periodic
 * rebuild (it would add load at a moment of its own).
 */
export function benchServiceEnv(port: number, databaseUrl: string, redisUrl: string, prefix: string): Record<string, string> {
  return {
    PORT: String(port),
    HOST: '127.0.0.1',
    DATABASE_URL: databaseUrl,
    REDIS_URL: redisUrl,
    REDIS_KEY_PREFIX: prefix,
    LOG_LEVEL: 'warn',
    LOG_REQUESTS: 'false',
    RECONCILE_INTERVAL_MS: '0',
  };
}

/** Resolves once `url` answers (any status); fails after 30 s. */
export async function waitHttp(url: string): Promise<void> {
  for (let i = 0; i < 300; i++) {
    try {
      await fetch(url, { signal: AbortSignal.timeout(1000) });
      return;
    } catch {
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  throw new Error(`${url} did not come up`);
}

export type Call = (method: string, path: string, body?: unknown) => Promise<{ status: number; body: any }>;

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

export function client(url: string, connections: number): { call: Call; close: () => Promise<void> } {
  const pool = new Pool(url, { connections, pipelining: 1, keepAliveTimeout: 30_000 });
  const call: Call = async (method, path, body) => {
    const res = await pool.request({
      method: method as 'GET',
      path,
      headers: body === undefined ? {} : { 'content-type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await res.body.text();
    return { status: res.statusCode, body: text ? JSON.parse(text) : undefined };
  };
  return { call, close: () => pool.close() };
}

/**
 * Runs `op` from `concurrency` loops for `durationMs` after `warmupMs`. `op` returns the outcome label
 * it wants latency recorded under (e.g. the status code), or the label and the latency of the part of
 * the operation that is measured (the rest, such as a clean-up request, is not).
 */
export async function runLoad(
  concurrency: number,
  durationMs: number,
  op: () => Promise<string | { label: string; ms: number }>,
  warmupMs = 1000,
  keepSamples = false,
): Promise<LoadResult> {
  const samples: { label: string; ms: number }[] = [];
  let measuring = false;
  let stop = false;
  const loops = Array.from({ length: concurrency }, async () => {
    while (!stop) {
      const t0 = performance.now();
      let label: string;
      let ms: number | undefined;
      try {
        const outcome = await op();
        if (typeof outcome === 'string') label = outcome;
        else ({ label, ms } = outcome);
      } catch (err) {
        label = `error:${(err as Error).message.slice(0, 40)}`;
      }
      if (measuring && !stop) samples.push({ label, ms: ms ?? performance.now() - t0 });
      // An operation that answers without any I/O must not starve the timer that ends the run.
      if (performance.now() - t0 < 0.05) await new Promise((resolve) => setImmediate(resolve));
    }
  });
  await new Promise((r) => setTimeout(r, warmupMs));
  measuring = true;
  const started = performance.now();
  await new Promise((r) => setTimeout(r, durationMs));
  stop = true;
  const elapsed = performance.now() - started;
  await Promise.all(loops);
  const all = samples.map((s) => s.ms).sort((a, b) => a - b);
  const byStatus: Record<string, number> = {};
  const grouped: Record<string, number[]> = {};
  for (const s of samples) {
    byStatus[s.label] = (byStatus[s.label] ?? 0) + 1;
    (grouped[s.label] ??= []).push(s.ms);
  }
  const latency: LoadResult['latency'] = {};
  for (const [label, list] of Object.entries(grouped)) {
    list.sort((a, b) => a - b);
    latency[label] = { p50: percentile(list, 50), p99: percentile(list, 99) };
  }
  return {
    rps: (samples.length / elapsed) * 1000,
    ops: samples.length,
    durationMs: elapsed,
    byStatus,
    p50: percentile(all, 50),
    p99: percentile(all, 99),
    latency,
    ...(keepSamples ? { samples: all } : {}),
  };
}

/**
 * Several runs taken as one: throughput over their summed time, percentiles over all their samples
 * (each run must have kept its samples).
 */
export function pooled(results: LoadResult[]): LoadResult {
  if (results.some((r) => r.samples === undefined)) throw new Error('pooled() needs runs that kept their samples');
  const all = results.flatMap((r) => r.samples!).sort((a, b) => a - b);
  const durationMs = results.reduce((sum, r) => sum + r.durationMs, 0);
  const byStatus: Record<string, number> = {};
  for (const r of results) for (const [label, n] of Object.entries(r.byStatus)) byStatus[label] = (byStatus[label] ?? 0) + n;
  return {
    rps: (all.length / durationMs) * 1000,
    ops: all.length,
    durationMs,
    byStatus,
    p50: percentile(all, 50),
    p99: percentile(all, 99),
    latency: {},
  };
}

/** The middle of an odd number of figures (of an even number, the upper of the two middle ones). */
export function medianOf(xs: number[]): number {
  return [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
}

/**
 * The median of the runs' p50s and, apart, of their p99s: a run whose latencies a burst of the machine's
 * noise spoilt moves neither (unlike percentiles over all their samples, which its worst 1 % can set).
 */
export function medianPercentiles(results: LoadResult[]): { p50: number; p99: number } {
  return { p50: medianOf(results.map((r) => r.p50)), p99: medianOf(results.map((r) => r.p99)) };
}

/** The median run of several, by throughput. */
export function median(results: LoadResult[]): LoadResult {
  const sorted = [...results].sort((a, b) => a.rps - b.rps);
  return sorted[Math.floor(sorted.length / 2)];
}
