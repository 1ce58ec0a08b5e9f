/**
 * The suite's Redis proxy (latency, dropped connections) in a process of its own. In the suite's main
 * process it shared an event loop with the ~1,000 simulated clients: when they all started at once, that
 * loop lagged by up to half a second, every Redis command of every instance crossed it twice, and the
 * instances rightly answered 503 (Redis, as they saw it, was too slow) outside any fault.
 *
 * Run as a child (fork) with the Redis port as argument; it reports {port} once listening, then obeys
 * {op: 'latency', ms} | {op: 'cut'} | {op: 'open'}, answering {done: id} for each.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { TcpProxy } from '../support/services.js';

type Command = { op: 'latency'; ms: number } | { op: 'cut' } | { op: 'open' };
type Order = Command & { id: number };

/** The driver's handle on the proxy process. */
export class ProxyProcess {
  private next = 0;
  private readonly waiting = new Map<number, () => void>();

  private constructor(
    private readonly child: ChildProcess,
    readonly port: number,
  ) {
    child.on('message', (m: { done?: number }) => {
      if (m.done === undefined) return;
      this.waiting.get(m.done)?.();
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

  private order(command: Command): Promise<void> {
    const id = this.next++;
    return new Promise<void>((resolve) => {
      this.waiting.set(id, resolve);
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
  process.on('message', (order: Order) => {
    const run = async () => {
      if (order.op === 'latency') proxy.latencyMs = order.ms;
      else if (order.op === 'cut') await proxy.cut();
      else await proxy.open();
    };
    void run().then(() => process.send!({ done: order.id }));
  });
  process.on('disconnect', () => process.exit(0));
  process.send({ port: proxy.port });
}
