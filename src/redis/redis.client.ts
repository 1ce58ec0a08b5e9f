import { Redis, ReplyError } from 'ioredis';
import { AppConfig } from '../config/app-config.js';
import { StartupError, endpoint, isRedisOutage, refused, unreachable } from '../common/dependency-errors.js';

export const REDIS = Symbol('REDIS');

/** How long ioredis waits before its `attempt`th reconnect: doubling from 100 ms, at most 2 s. */
export const reconnectDelay = (attempt: number): number => Math.min(50 * 2 ** Math.min(attempt, 6), 2000);

/**
 * Logs each distinct error of a connection once (`warn`), until it is ready again: a Redis that is down makes ioredis
 * report the same error at every reconnect attempt. The requests that meet the outage answer 503 on their own.
 */
export function warnEachError(redis: Redis, warn: (message: string) => void): void {
  let last = '';
  redis.on('error', (err: Error) => {
    if (err.message !== last) warn(err.message);
    last = err.message;
  });
  redis.on('ready', () => {
    last = '';
  });
}

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
    retryStrategy: reconnectDelay,
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
export function withTimeout<T>(command: Promise<T>, ms: number, watch?: ConnectionWatch): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    let settled = false;
    const settle = (finish: () => void) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      finish();
    };
    const timer = setTimeout(
      () =>
        setImmediate(() =>
          settle(() => {
            watch?.timedOut();
            reject(new Error(REDIS_TIMEOUT_MESSAGE));
          }),
        ),
      ms,
    );
    command.then(
      (value) =>
        settle(() => {
          watch?.answered();
          resolve(value);
        }),
      (err: unknown) =>
        settle(() => {
          // A reply (an error Redis sent) is an answer; a closed connection is ioredis' to make again.
          if (err instanceof ReplyError) watch?.answered();
          reject(err);
        }),
    );
  });
}

/** Told of each command `withTimeout` bounds: answered by Redis in time, or not (HoldStore's watch of its connection). */
export interface ConnectionWatch {
  answered(): void;
  timedOut(): void;
}

/** Redis' maxmemory-policy, from INFO memory ("unknown" if INFO does not say). */
export function evictionPolicyOf(info: string): string {
  return /maxmemory_policy:(\S+)/.exec(info)?.[1] ?? 'unknown';
}

/** Why a Redis with this maxmemory-policy may not be used, or null when it may (noeviction). */
export function evictionRefusal(url: URL, policy: string): string | null {
  if (policy === 'noeviction') return null;
  const { host, port } = endpoint(url, 6379);
  return (
    `Redis at ${host}:${port} has maxmemory-policy "${policy}"; respool needs "noeviction" because an ` +
    `evicted hold would let two callers take the same item. Run: redis-cli -h ${host} -p ${port} CONFIG SET ` +
    'maxmemory-policy noeviction (and set it in redis.conf).'
  );
}

/**
 * Start-up checks of a connected Redis: the database the URL names is the one in use (ioredis only warns when
 * its SELECT fails, and goes on in database 0, perhaps beside another deployment's keys), and Redis may not
 * evict keys (an evicted hold is a double allocation). Each failure is a StartupError that says where.
 */
export async function assertUsableRedis(redis: Redis, url: URL, timeoutMs: number): Promise<void> {
  const db = redis.options.db ?? 0;
  const ask = async <T>(command: () => Promise<T>, what: string, hint: string): Promise<T> => {
    try {
      return await withTimeout(command(), timeoutMs);
    } catch (err) {
      throw isRedisOutage(err) ? unreachable('Redis', url, 6379, err) : refused('Redis', url, 6379, what, err, hint);
    }
  };
  if (db !== 0) await ask(() => redis.select(db), `database ${db}`, 'name a database Redis has, in REDIS_URL');
  const info = await ask(() => redis.info('memory'), 'INFO', 'respool reads maxmemory-policy with it: allow the user INFO');
  const refusal = evictionRefusal(url, evictionPolicyOf(info));
  if (refusal) throw new StartupError(refusal);
}
