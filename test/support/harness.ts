import type { NestFastifyApplication } from '@nestjs/platform-fastify';
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { onTestFinished, vi } from 'vitest';
import { closeGracefully, createApp } from '../../src/app.factory.js';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { AllocationResult, ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore, READ_MAX_AGE_MS } from '../../src/redis/hold-store.repository.js';
import { AppConfig, loadConfig } from '../../src/config/app-config.js';
import { SweeperService } from '../../src/sweeper/sweeper.service.js';
import { REDIS_URL, databaseUrl, deleteKeys, dropDatabase } from './services.js';

export interface HttpAnswer<T = any> {
  status: number;
  body: T;
  headers: Headers;
}

/** A running respool instance on a loopback port, talking to real Postgres and Redis. */
export class TestInstance {
  constructor(
    readonly app: NestFastifyApplication,
    readonly url: string,
    readonly config: AppConfig,
  ) {}

  async request<T = any>(method: string, path: string, body?: unknown, headers: Record<string, string> = {}): Promise<HttpAnswer<T>> {
    const res = await fetch(`${this.url}${path}`, {
      method,
      headers: body === undefined ? headers : { 'content-type': 'application/json', ...headers },
      body: body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body),
    });
    const text = await res.text();
    let parsed: unknown = text;
    try {
      parsed = text ? JSON.parse(text) : undefined;
    } catch {
      /* not JSON (metrics, docs) */
    }
    return { status: res.status, body: parsed as T, headers: res.headers };
  }

  get = <T = any>(path: string) => this.request<T>('GET', path);
  post = <T = any>(path: string, body: unknown = {}, headers?: Record<string, string>) => this.request<T>('POST', path, body, headers);
  del = <T = any>(path: string) => this.request<T>('DELETE', path);
  /** The pool's item counts by state, as GET /v1/pools/{pool} gives them. */
  stats = async (pool: string) => (await this.get(`/v1/pools/${pool}`)).body.stats;

  /**
   * Closes the app as SIGTERM does (closeGracefully). A connection the tests' own HTTP client opened and sent nothing
   * on (undici does, after an aborted request) is not idle to Node, and would hold the close for the server's
   * keep-alive timeout (72 s): whatever is still connected 5 s into the close is cut.
   */
  async close(): Promise<void> {
    const server = this.app.getHttpServer();
    const cut = setTimeout(() => server.closeAllConnections(), 5000);
    try {
      await closeGracefully(this.app);
    } finally {
      clearTimeout(cut);
    }
  }
}

/**
 * One test file's world: its own database and Redis key prefix, any number of instances on them,
 * and a direct Postgres connection to check what really got committed. `cleanup` drops it all.
 */
export class TestWorld {
  readonly dbName: string;
  readonly prefix: string;
  readonly instances: TestInstance[] = [];
  private sql: pg.Pool | undefined;

  constructor(
    name: string,
    private readonly env: Record<string, string> = {},
  ) {
    const tag = `${name}_${process.pid}_${randomBytes(3).toString('hex')}`;
    this.dbName = `respool_test_${tag}`.toLowerCase();
    this.prefix = `rptest:${tag}:`;
  }

  config(overrides: Record<string, string> = {}): AppConfig {
    return loadConfig({
      DATABASE_URL: databaseUrl(this.dbName),
      REDIS_URL,
      REDIS_KEY_PREFIX: this.prefix,
      LOG_LEVEL: process.env.TEST_LOG_LEVEL ?? 'error',
      LOG_REQUESTS: 'false',
      SWEEP_INTERVAL_MS: '100',
      ...this.env,
      ...overrides,
    });
  }

  async start(overrides: Record<string, string> = {}): Promise<TestInstance> {
    const config = this.config(overrides);
    const app = await createApp(config, { logger: process.env.TEST_LOG_LEVEL !== undefined });
    await app.listen({ port: 0, host: '127.0.0.1' });
    const address = app.getHttpServer().address() as { port: number };
    const instance = new TestInstance(app, `http://127.0.0.1:${address.port}`, config);
    this.instances.push(instance);
    return instance;
  }

  /** Direct SQL against this world's database, to check outcomes independently of the API. */
  async query<T = any>(text: string, params: unknown[] = []): Promise<T[]> {
    if (!this.sql) {
      this.sql = new pg.Pool({ connectionString: databaseUrl(this.dbName), max: 2 });
      // pool.end() resolves before its sockets have closed; the DROP DATABASE ... WITH (FORCE) of cleanup
      // then ends those sessions, and the pool reports it as an error on a client it no longer has.
      this.sql.on('error', () => undefined);
    }
    return (await this.sql.query(text, params)).rows as T[];
  }

  /** Drops it all; each step runs whatever the others did, and the first failure is thrown at the end. */
  async cleanup(): Promise<void> {
    for (const instance of this.instances.splice(0)) await instance.close().catch(() => undefined);
    const steps = await Promise.allSettled([this.sql?.end()]);
    steps.push(...(await Promise.allSettled([dropDatabase(this.dbName), deleteKeys(this.env.REDIS_URL ?? REDIS_URL, this.prefix)])));
    const failed = steps.find((step): step is PromiseRejectedResult => step.status === 'rejected');
    if (failed) throw failed.reason;
  }
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A Redis clock stamp (HoldStore.clock) made too long before its write: Redis refuses the write (READ_MAX_AGE_MS). */
export const staleReadAt = (readAt: number) => readAt - READ_MAX_AGE_MS - 1000;

/** Polls `check` until it returns a truthy value or `timeoutMs` passes; returns the value and the time it took. */
export async function eventually<T>(check: () => Promise<T | undefined | null | false>, timeoutMs: number, everyMs = 50) {
  const started = Date.now();
  for (;;) {
    const value = await check();
    if (value) return { value, elapsedMs: Date.now() - started };
    if (Date.now() - started > timeoutMs) throw new Error(`condition not met within ${timeoutMs} ms`);
    await sleep(everyMs);
  }
}

/** Waits until the instance finds Redis rebuilt (the marker says so), at most `timeoutMs`. */
export async function untilRebuilt(instance: TestInstance, timeoutMs = 10_000): Promise<void> {
  await eventually(async () => (await instance.app.get(HoldStore).rebuildState()) === 'rebuilt', timeoutMs);
}

/**
 * For a test that drives the rebuild (and the checkpoint) by hand: the instances' sweepers leave them alone until the
 * test is over.
 */
export function quietSweepers(...instances: TestInstance[]): void {
  const spies = instances.map((instance) =>
    vi
      .spyOn(instance.app.get(SweeperService) as unknown as { rebuildIfNeeded: () => Promise<void> }, 'rebuildIfNeeded')
      .mockResolvedValue(),
  );
  onTestFinished(() => spies.forEach((spy) => spy.mockRestore()));
}

/** Reserves one item of `pool` for `owner` as soon as one is free (a 201 within `timeoutMs`). */
export async function reserveWhenFree(api: TestInstance, pool: string, owner: string, timeoutMs = 5000): Promise<HttpAnswer> {
  const { value } = await eventually(async () => {
    const r = await api.post(`/v1/pools/${pool}/reservations`, { owner, count: 1 });
    return r.status === 201 ? r : null;
  }, timeoutMs);
  return value;
}

/** Creates a pool and imports `values` into it; returns the resource ids by value. */
export async function seedPool(
  api: TestInstance,
  name: string,
  values: (string | { value: string; attributes?: Record<string, string>; groupKey?: string })[],
  pool: Record<string, unknown> = {},
): Promise<void> {
  const created = await api.post('/v1/pools', { name, kind: 'number', ...pool });
  if (created.status !== 201) throw new Error(`pool ${name}: ${created.status} ${JSON.stringify(created.body)}`);
  const items = values.map((v) => (typeof v === 'string' ? { value: v } : v));
  for (let i = 0; i < items.length; i += 10_000) {
    const imported = await api.post(`/v1/pools/${name}/resources`, { items: items.slice(i, i + 10_000) });
    if (imported.status !== 201) throw new Error(`import ${name}: ${imported.status} ${JSON.stringify(imported.body)}`);
  }
}

export const numbers = (n: number, prefix = '1380000') => Array.from({ length: n }, (_, i) => `${prefix}${String(i).padStart(4, '0')}`);

/**
 * A confirm that pins its hold on `resourceId` (commit window `windowMs`) and then stalls before Postgres,
 * like a paused or slow instance. `land()` sends its commit late, with the version the hold was taken at.
 */
export async function stalledConfirm(api: TestInstance, pool: string, reservationId: string, resourceId: string, windowMs: number) {
  const pinned = await api.app.get(HoldStore).pin(pool, reservationId, [resourceId], windowMs);
  if (pinned.status !== 'pinned') throw new Error(`pin: ${pinned.status}`);
  const land = async (): Promise<AllocationResult> => {
    const entity = await api.app.get(PoolRepository).findByName(pool);
    const r = pinned.reservation;
    const item = r.items.find((i) => i.id === resourceId)!;
    // The answer the confirm would have stored (see CommitService).
    const body = {
      selection: [resourceId],
      allocated: [{ resourceId, value: item.v, version: item.n + 1 }],
      released: r.items.filter((i) => i.id !== resourceId).map((i) => i.id),
      owner: r.owner,
      items: r.items,
      expiresMs: r.expiresMs,
    };
    return api.app.get(ResourceRepository).allocate({
      poolId: entity!.id,
      owner: r.owner,
      reservationId,
      epoch: r.epoch,
      generation: r.generation,
      items: [{ id: resourceId, version: item.n }],
      body: JSON.stringify(body),
    });
  };
  return { pinned, land };
}
