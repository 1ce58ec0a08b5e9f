import { Redis } from 'ioredis';
import { AppConfig } from '../config/app-config.js';

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
    commandTimeout: config.REDIS_TIMEOUT_MS,
    connectTimeout: config.REDIS_TIMEOUT_MS,
    enableAutoPipelining: true,
    retryStrategy: (attempt) => Math.min(50 * 2 ** Math.min(attempt, 6), 2000),
    reconnectOnError: (err) => /READONLY|LOADING/.test(err.message),
  });
}

export class EvictionPolicyError extends Error {}

/** Refuses to run on a Redis that may evict keys: an evicted hold is a double allocation. */
export async function assertNoEviction(redis: Redis): Promise<void> {
  const info = await redis.info('memory');
  const policy = /maxmemory_policy:(\S+)/.exec(info)?.[1];
  if (policy !== 'noeviction') {
    throw new EvictionPolicyError(
      `Redis maxmemory-policy is "${policy ?? 'unknown'}"; respool needs "noeviction" because an evicted hold ` +
        'would let two callers take the same item. Run: redis-cli CONFIG SET maxmemory-policy noeviction ' +
        '(and set it in redis.conf).',
    );
  }
}
