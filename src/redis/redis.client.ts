import { Redis } from 'ioredis';
import { AppConfig } from '../config/app-config.js';
import { endpoint } from '../common/dependency-errors.js';

export const REDIS = Symbol('REDIS');

/**
 * One connection per instance. Commands fail at once while Redis is unreachable (no offline queue) and
 * are never re-sent after a reconnect, so callers answer 503 instead of piling requests up, and a 503
 * changed nothing later either; ioredis reconnects on its own with backoff.
 */
export function createRedis(config: AppConfig): Redis {
  return new Redis(config.REDIS_URL, {
    lazyConnect: true,
    enableOfflineQueue: false,
    // A command in flight when the connection dropped has already been answered as a failure (503, or a
    // timeout): it must not run later on the reconnected, possibly wiped and rebuilt, Redis. Re-sent, a
    // reserve would hold items for a caller that was told nothing happened, and an add_free would put
    // back items that were allocated while it waited.
    autoResendUnfulfilledCommands: false,
    maxRetriesPerRequest: 1,
    // HoldStore bounds every command at REDIS_TIMEOUT_MS with `withTimeout` (below). ioredis' own timeout
    // is only the backstop that ends commands which will never be answered (in flight when a connection
    // dropped): until they end, the auto-pipeline they were sent in holds back every later command.
    commandTimeout: 2 * config.REDIS_TIMEOUT_MS,
    connectTimeout: config.REDIS_TIMEOUT_MS,
    enableAutoPipelining: true,
    retryStrategy: (attempt) => Math.min(50 * 2 ** Math.min(attempt, 6), 2000),
    reconnectOnError: (err) => /READONLY|LOADING/.test(err.message),
  });
}

/** The error of a command that got no answer in time. It may still run in Redis, or have run. */
export const REDIS_TIMEOUT_MESSAGE = 'Command timed out';

/** Redis' clock in ms from a TIME reply (seconds, microseconds), as the scripts' now_ms() reads it. */
export async function redisNowMs(redis: Pick<Redis, 'time'>): Promise<number> {
  const [seconds, micros] = await redis.time();
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

/**
 * `command`'s outcome, or a REDIS_TIMEOUT_MESSAGE error once `ms` have passed without one. The timeout's
 * verdict waits for the next check phase of the event loop (setImmediate), after the sockets were read.
 * When this process stalls (garbage collection, a cold start compiling code on a busy machine, SIGSTOP),
 * its expired timers run before the poll phase reads what arrived meanwhile. A plain timer, like
 * ioredis' `commandTimeout`, would then fail a command whose answer is already waiting in the socket,
 * and the caller would get a 503 for nothing. (A stall longer than ioredis' backstop, twice `ms` in
 * createRedis, still fails the commands in flight.)
 */
export function withTimeout<T>(command: Promise<T>, ms: number): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    let settled = false;
    const settle = (finish: () => void) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      finish();
    };
    const timer = setTimeout(() => setImmediate(() => settle(() => reject(new Error(REDIS_TIMEOUT_MESSAGE)))), ms);
    command.then(
      (value) => settle(() => resolve(value)),
      (err: unknown) => settle(() => reject(err)),
    );
  });
}

export class EvictionPolicyError extends Error {}

/** Refuses to run on a Redis that may evict keys: an evicted hold is a double allocation. */
export async function assertNoEviction(redis: Redis, url: URL, timeoutMs: number): Promise<void> {
  const info = await withTimeout(redis.info('memory'), timeoutMs);
  const policy = /maxmemory_policy:(\S+)/.exec(info)?.[1];
  if (policy !== 'noeviction') {
    const { host, port } = endpoint(url, 6379);
    throw new EvictionPolicyError(
      `Redis at ${host}:${port} has maxmemory-policy "${policy ?? 'unknown'}"; respool needs "noeviction" because an ` +
        `evicted hold would let two callers take the same item. Run: redis-cli -h ${host} -p ${port} CONFIG SET ` +
        'maxmemory-policy noeviction (and set it in redis.conf).',
    );
  }
}
