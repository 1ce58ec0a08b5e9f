import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { loadConfig } from '../../src/config/app-config.js';
import { REDIS_TIMEOUT_MESSAGE, createRedis, withTimeout } from '../../src/redis/redis.client.js';
import { REDIS_URL } from '../support/services.js';

/** Blocks this process's event loop, as a long GC pause or a starved cold start does. */
function stall(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

describe('Redis command timeouts (withTimeout)', () => {
  // The service's own client, as createRedis configures it.
  const config = loadConfig({ DATABASE_URL: 'postgres://unused', REDIS_URL, REDIS_TIMEOUT_MS: '200' });
  const redis = createRedis(config);
  beforeAll(() => redis.connect());
  afterAll(() => redis.quit());

  it('an answer that arrived while the process was stalled wins over the timer that expired meanwhile', async () => {
    const ping = withTimeout(redis.ping(), config.REDIS_TIMEOUT_MS);
    // The PING is written before immediates run; Redis answers within a millisecond, into the socket,
    // while this process is stalled for 1.5 timeouts. When it resumes, the expired timer runs first.
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        stall(300);
        resolve();
      }),
    );
    await expect(ping).resolves.toBe('PONG');
  });

  it('a command with no answer fails with the timeout error after the timeout, not before', async () => {
    // Its own connection: BLPOP on a list nobody fills holds the connection until Redis answers, after 2 s.
    const blocking = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
    try {
      await blocking.ping();
      const started = Date.now();
      const blocked = withTimeout(blocking.blpop(`rptest:timeout:${process.pid}:${Date.now()}`, 2), 150);
      await expect(blocked).rejects.toThrow(REDIS_TIMEOUT_MESSAGE);
      const waited = Date.now() - started;
      expect(waited).toBeGreaterThanOrEqual(145);
      expect(waited).toBeLessThan(1500);
    } finally {
      blocking.disconnect();
    }
  });

  it("a command's own error passes through unchanged", async () => {
    await expect(withTimeout(redis.call('NO-SUCH-COMMAND'), config.REDIS_TIMEOUT_MS)).rejects.toThrow(/unknown command/i);
  });
});
