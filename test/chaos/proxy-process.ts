/**
 * The suite's Redis proxy (latency, dropped connections) in a process of its own. In the suite's main
 * process it shared an event loop with the ~1,000 simulated clients: when they all started at once, that
 * loop lagged by up to half a second, every Redis command of every instance crossed it twice, and the
 * instances rightly answered 503 (Redis, as they saw it, was too slow) outside any fault.
 *
 * It also stops an instance at a given point of a confirm, for the pause scenario: the driver's own loop
 * lags too much under the load to catch the few tens of milliseconds that point lasts.
 *
 * Run as a child (fork) with the Redis port as argument; it reports {port} once listening, then obeys
 * {op: 'latency', ms} | {op: 'cut'} | {op: 'open'} | {op: 'stopWhenPinned', key, pid, timeoutMs},
 * answering {done: id, result} for each.
 */
import { Redis } from 'ioredis';
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { TcpProxy } from '../support/services.js';

type Command =
  { op: 'latency'; ms: number } | { op: 'cut' } | { op: 'open' } | { op: 'stopWhenPinned'; key: string; pid: number; timeoutMs: number };
type Order = Command & { id: number };

/** The driver's handle on the proxy process. */
export class ProxyProcess {
  private next = 0;
  private readonly waiting = new Map<number, (result: unknown) => void>();

  private constructor(
    private readonly child: ChildProcess,
    readonly port: number,
  ) {
    child.on('message', (m: { done?: number; result?: unknown }) => {
      if (m.done === undefined) return;
      this.waiting.get(m.done)?.(m.result);
      this.waiting.delete(m.done);
    });
  }

  static async start(redisPort: number): Promise<ProxyProcess> {
    const child = fork(fileURLToPath(import.meta.url), [String(redisPort)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
    const port = await new Promise<number>((resolve, reject) => {
      child.once('message', (m: { port: number }) => resolve(m.port));
      child.once('exit', (code) => reject(new Error(`the Redis proxy exited with ${code}`)));
    });
    return new ProxyProcess(child, port);
  }

  private order<T = void>(command: Command): Promise<T> {
    const id = this.next++;
    return new Promise<T>((resolve) => {
      this.waiting.set(id, resolve as (result: unknown) => void);
      this.child.send({ ...command, id });
    });
  }

  setLatency(ms: number): Promise<void> {
    return this.order({ op: 'latency', ms });
  }

  cut(): Promise<void> {
    return this.order({ op: 'cut' });
  }

  open(): Promise<void> {
    return this.order({ op: 'open' });
  }

  /**
   * Sends SIGSTOP to `pid` as soon as the reservation hash `key` reads state 'confirming' (its confirm's pin
   * has run in Redis), read straight from Redis, not through the proxy. Resolves with how long that took
   * after the order arrived, or null if it did not happen within `timeoutMs` (nothing was stopped then).
   */
  stopWhenPinned(key: string, pid: number, timeoutMs: number): Promise<number | null> {
    return this.order<number | null>({ op: 'stopWhenPinned', key, pid, timeoutMs });
  }

  async stop(): Promise<void> {
    if (this.child.exitCode !== null) return;
    await this.cut();
    await new Promise<void>((resolve) => {
      this.child.once('exit', () => resolve());
      this.child.kill();
    });
  }
}

// Started by ProxyProcess.start: the proxy itself.
if (process.send && process.argv[1] === fileURLToPath(import.meta.url)) {
  const proxy = await TcpProxy.start(Number(process.argv[2]));
  const watcher = new Redis(Number(process.argv[2]), '127.0.0.1', { maxRetriesPerRequest: 1 });
  watcher.on('error', () => undefined); // Redis is killed and flushed on purpose; the watcher reconnects
  const stopWhenPinned = async (key: string, pid: number, timeoutMs: number): Promise<number | null> => {
    const started = Date.now();
    while (Date.now() - started < timeoutMs) {
      if ((await watcher.hget(key, 's').catch(() => null)) === 'confirming') {
        process.kill(pid, 'SIGSTOP');
        return Date.now() - started;
      }
    }
    return null;
  };
  process.on('message', (order: Order) => {
    const run = async (): Promise<unknown> => {
      if (order.op === 'latency') proxy.latencyMs = order.ms;
      else if (order.op === 'cut') await proxy.cut();
      else if (order.op === 'open') await proxy.open();
      else return stopWhenPinned(order.key, order.pid, order.timeoutMs);
      return undefined;
    };
    void run().then((result) => process.send!({ done: order.id, result }));
  });
  process.on('disconnect', () => process.exit(0));
  process.send({ port: proxy.port });
}
