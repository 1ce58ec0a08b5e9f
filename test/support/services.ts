import { spawn, ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import net from 'node:net';
import pg from 'pg';
import { Redis } from 'ioredis';

export const PG_ADMIN_URL = process.env.TEST_PG_ADMIN_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
export const REDIS_URL = process.env.TEST_REDIS_URL ?? 'redis://127.0.0.1:6379';

/**
 * How the built service is started in production: the arguments of `npm run start:prod` after `node`
 * (its V8 flags, then the entry point), so the chaos suite and the bench run it the same way. Run
 * from the project's root, as npm runs its scripts.
 */
export function serviceArgs(): string[] {
  const pkg = JSON.parse(readFileSync('package.json', 'utf8')) as { scripts: Record<string, string> };
  const [node, ...args] = pkg.scripts['start:prod'].split(/\s+/);
  if (node !== 'node') throw new Error(`start:prod should start with "node": ${pkg.scripts['start:prod']}`);
  return args;
}

/** Listens on a loopback port (0: any) and closes again; the port it got, or null if it was taken. */
function tryListen(port: number): Promise<number | null> {
  return new Promise((resolve) => {
    const server = net.createServer();
    server.once('error', () => resolve(null));
    server.listen(port, '127.0.0.1', () => {
      const { port: got } = server.address() as net.AddressInfo;
      server.close(() => resolve(got));
    });
  });
}

/** The lowest port the kernel hands out on its own (to outgoing connections and to listen(0)). */
function ephemeralLow(): number {
  try {
    const low = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]);
    return Number.isInteger(low) && low > 0 ? low : 32768;
  } catch {
    return 32768;
  }
}

/**
 * A free loopback port for a server a test starts, stops and starts again (an instance it kills, its own Redis
 * or Postgres). Taken below the kernel's ephemeral range: a port from that range may, while the server is
 * down, become the local port of an outgoing connection or another process's listen(0), and the server then
 * cannot start again, or a check of its health reaches that other process (seen in CI: EADDRINUSE).
 */
export async function freePort(): Promise<number> {
  const low = Math.min(ephemeralLow(), 65536);
  const from = 10_000;
  for (let attempt = 0; low > from + 1000 && attempt < 100; attempt++) {
    const port = from + Math.floor(Math.random() * (low - from));
    if ((await tryListen(port)) !== null) return port;
  }
  // No room below that range: any port the kernel finds free.
  const any = await tryListen(0);
  if (any === null) throw new Error('no free loopback port');
  return any;
}

/** A database URL of its own for one test file; the app creates the database on start. */
export function databaseUrl(name: string): string {
  const url = new URL(PG_ADMIN_URL);
  url.pathname = `/${name}`;
  return url.toString();
}

export async function dropDatabase(name: string): Promise<void> {
  const client = new pg.Client({ connectionString: PG_ADMIN_URL });
  await client.connect();
  try {
    await client.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  } finally {
    await client.end();
  }
}

export async function deleteKeys(redisUrl: string, prefix: string): Promise<void> {
  const redis = new Redis(redisUrl);
  try {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 1000);
      cursor = next;
      if (keys.length) await redis.unlink(...keys);
    } while (cursor !== '0');
  } finally {
    redis.disconnect();
  }
}

/** A redis-server of the test's own, on a spare loopback port, that the test may flush, stop and restart. */
export class OwnRedis {
  private child: ChildProcess | undefined;
  /**
   * `under`: a command the server runs under (valgrind and its options, say), then redis-server and its arguments;
   * `readyWithinMs`: how long it may take to answer PING (far longer under valgrind).
   */
  constructor(
    readonly port: number,
    private readonly under: string[] = [],
    private readonly readyWithinMs = 10_000,
  ) {}

  static async start(extraArgs: string[] = [], under: string[] = [], readyWithinMs?: number): Promise<OwnRedis> {
    const own = new OwnRedis(await freePort(), under, readyWithinMs);
    await own.start(extraArgs);
    return own;
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** The process started (redis-server, or the command it runs under). */
  get pid(): number | undefined {
    return this.child?.pid;
  }

  async start(extraArgs: string[] = []): Promise<void> {
    const [command, ...args] = [
      ...this.under,
      'redis-server',
      ...['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', ...extraArgs],
    ];
    this.child = spawn(command, args, { stdio: 'ignore' });
    for (const deadline = Date.now() + this.readyWithinMs; Date.now() < deadline;) {
      const probe = new Redis(this.url, { lazyConnect: true, retryStrategy: () => null, maxRetriesPerRequest: 0 });
      probe.on('error', () => undefined); // refused while the server starts: expected
      try {
        await probe.connect();
        await probe.ping();
        probe.disconnect();
        return;
      } catch {
        probe.disconnect();
        await new Promise((r) => setTimeout(r, 50));
      }
    }
    throw new Error(`${command} on port ${this.port} did not start`);
  }

  async stop(): Promise<void> {
    const child = this.child;
    if (!child || child.exitCode !== null) return;
    await new Promise<void>((resolve) => {
      child.once('exit', () => resolve());
      child.kill('SIGKILL');
    });
    this.child = undefined;
  }

  client(): Redis {
    return new Redis(this.url);
  }
}

/**
 * A TCP proxy in front of a real server that a test can slow down (latency added to every chunk, in
 * order), black-hole (the connections open go silent) or cut (every connection dropped, new ones refused) and restore.
 */
export class TcpProxy {
  private server: net.Server | undefined;
  private readonly sockets = new Set<net.Socket>();
  /** Sockets whose data is dropped (blackHole): the peer seems gone, without a reset. */
  private readonly holed = new WeakSet<net.Socket>();
  latencyMs = 0;

  private constructor(
    readonly port: number,
    private readonly targetPort: number,
  ) {}

  static async start(targetPort: number): Promise<TcpProxy> {
    const proxy = new TcpProxy(await freePort(), targetPort);
    await proxy.open();
    return proxy;
  }

  private relay(from: net.Socket, to: net.Socket): void {
    let chain = Promise.resolve();
    from.on('data', (chunk) => {
      if (this.holed.has(from)) return;
      const delay = this.latencyMs;
      if (delay === 0) {
        to.write(chunk);
        return;
      }
      from.pause();
      chain = chain.then(async () => {
        await new Promise((r) => setTimeout(r, delay));
        if (!to.destroyed) to.write(chunk);
        from.resume();
      });
    });
  }

  async open(): Promise<void> {
    this.server = net.createServer((client) => {
      const upstream = net.connect(this.targetPort, '127.0.0.1');
      for (const s of [client, upstream]) {
        this.sockets.add(s);
        s.on('close', () => this.sockets.delete(s));
        s.on('error', () => s.destroy());
      }
      this.relay(client, upstream);
      this.relay(upstream, client);
      client.on('close', () => upstream.destroy());
      upstream.on('close', () => client.destroy());
    });
    await new Promise<void>((resolve) => this.server!.listen(this.port, '127.0.0.1', resolve));
  }

  /**
   * The connections open now carry nothing more, either way, and stay open (a failover or a NAT that left them
   * black-holed, the peer gone without a reset); new ones are relayed as before.
   */
  blackHole(): void {
    for (const s of this.sockets) this.holed.add(s);
  }

  async cut(): Promise<void> {
    const server = this.server;
    this.server = undefined;
    for (const s of this.sockets) s.destroy();
    if (server) await new Promise<void>((resolve) => server.close(() => resolve()));
  }
}
