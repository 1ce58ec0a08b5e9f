import { spawn, spawnSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { cpuPerOp, cpuSnapshot } from './cpu.js';
import type { CpuProbe, LoadResult } from './load.js';

/**
 * wrk (C, epoll) as the load generator for single-request operations: at these rates a Node load
 * generator takes most of a core that the service and the databases would otherwise get, and its own
 * event loop adds to the latencies it reports. Operations made of several dependent requests (reserve
 * then release, pull then complete) stay on the Node loader (load.ts).
 */
export const WRK_THREADS = 2;
const SCRIPT = join(import.meta.dirname, '..', '..', '..', 'bench', 'wrk.lua');

/** Installs wrk from Debian's packages when it is missing and this process may (root); else explains. */
export function ensureWrk(): void {
  if (spawnSync('wrk', ['--version']).error === undefined) return;
  if (process.getuid?.() !== 0) throw new Error('the bench needs wrk: sudo apt-get install wrk');
  console.log('[bench] installing wrk from Debian packages');
  for (const args of [
    ['update', '-qq'],
    ['install', '-y', '-qq', 'wrk'],
  ]) {
    const r = spawnSync('apt-get', args, { stdio: 'inherit', env: { ...process.env, DEBIAN_FRONTEND: 'noninteractive' } });
    if (r.status !== 0) throw new Error(`apt-get ${args.join(' ')} failed; install wrk and run the bench again`);
  }
}

export type WrkRequest = { method: string; path: string; body?: unknown };

/** Writes requests to a file for `runWrk({ requestsFile })`: each is sent once. */
export function requestsFile(requests: WrkRequest[]): string {
  const file = join(tmpdir(), `respool-wrk-${process.pid}-${Date.now()}.tsv`);
  writeFileSync(file, requests.map((r) => `${r.method}\t${r.path}\t${r.body === undefined ? '' : JSON.stringify(r.body)}\n`).join(''));
  return file;
}

/**
 * Runs wrk against `url` for `durationMs` (after an unmeasured warm-up of `warmupMs` when the request is
 * fixed), with `connections` connections. Either `request` is sent over and over, or each line of
 * `requestsFile` once; a run that uses them all up fails.
 */
export async function runWrk(
  url: string,
  connections: number,
  durationMs: number,
  what: { request: WrkRequest } | { requestsFile: string },
  warmupMs = 1000,
  probe?: CpuProbe,
): Promise<LoadResult> {
  if ('request' in what && warmupMs > 0) await wrk(url, connections, warmupMs, what);
  const cpuBefore = probe && cpuSnapshot(probe.groupOf);
  const r = await wrk(url, connections, durationMs, what);
  const cpuAfter = probe && cpuSnapshot(probe.groupOf);
  if (r.ranDry > 0) throw new Error('wrk used up its requests file; make more requests');
  const seconds = r.durationUs / 1e6;
  // wrk counts responses that are not 2xx/3xx; the bench only needs how many succeeded.
  const byStatus: Record<string, number> = { '2xx': r.requests - r.non2xx, 'not 2xx': r.non2xx };
  if (r.errors > 0) byStatus['socket errors'] = r.errors;
  const p50 = r.p50Us / 1000;
  const p99 = r.p99Us / 1000;
  const cpu = probe && cpuPerOp(cpuBefore!, cpuAfter!, r.requests, probe.order);
  return { rps: r.requests / seconds, ops: r.requests, durationMs: seconds * 1000, byStatus, p50, p99, latency: {}, cpu };
}

interface WrkOutput {
  requests: number;
  durationUs: number;
  errors: number;
  ranDry: number;
  p50Us: number;
  p99Us: number;
  non2xx: number;
}

function wrk(
  url: string,
  connections: number,
  durationMs: number,
  what: { request: WrkRequest } | { requestsFile: string },
): Promise<WrkOutput> {
  const env: Record<string, string> = { ...(process.env as Record<string, string>), WRK_THREADS: String(WRK_THREADS) };
  if ('request' in what) {
    env.WRK_METHOD = what.request.method;
    env.WRK_PATH = what.request.path;
    if (what.request.body !== undefined) env.WRK_BODY = JSON.stringify(what.request.body);
  } else {
    env.WRK_REQUESTS = what.requestsFile;
  }
  const seconds = Math.max(1, Math.round(durationMs / 1000));
  const args = ['-t', String(WRK_THREADS), '-c', String(connections), '-d', `${seconds}s`, '--timeout', '10s', '-s', SCRIPT, url];
  return new Promise((resolve, reject) => {
    const child = spawn('wrk', args, { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    child.stderr.on('data', (d: Buffer) => (err += d.toString()));
    child.on('error', (e) => reject(new Error(`wrk could not start (${e.message}); install it: apt-get install wrk`)));
    child.on('close', (code) => {
      const line = out.split('\n').find((l) => l.startsWith('WRK_RESULT '));
      if (code !== 0 || !line) return reject(new Error(`wrk exited with ${code}: ${err || out}`));
      resolve(JSON.parse(line.slice('WRK_RESULT '.length)) as WrkOutput);
    });
  });
}
