import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SweeperService } from '../../src/sweeper/sweeper.service.js';
import { SWEEP_BATCH } from '../../src/sweeper/sweep-limits.js';
import { TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';

describe('sweeper', () => {
  // The timer would sweep on its own every 10 s (the longest interval allowed); the test ticks by hand first.
  const world = new TestWorld('sweeper', { SWEEP_INTERVAL_MS: '10000' });
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  it('one tick returns every expired hold, however many sweep batches that takes', async () => {
    const n = Math.floor(SWEEP_BATCH * 2.5);
    await seedPool(api, 'bulk', numbers(n));
    for (let i = 0; i < n; i += 50) {
      const answers = await Promise.all(
        Array.from({ length: Math.min(50, n - i) }, () => api.post('/v1/pools/bulk/reservations', { owner: 'o', count: 1, ttlMs: 1000 })),
      );
      expect(answers.map((a) => a.status)).toEqual(answers.map(() => 201));
    }
    const stats = async () => (await api.get('/v1/pools/bulk')).body.stats;
    expect(await stats()).toEqual({ total: n, free: 0, held: n, allocated: 0 });
    await sleep(1200 + api.config.HOLD_GRACE_MS); // every hold has expired, and its grace has run out
    expect((await stats()).free).toBe(0); // and the timer has not swept yet

    await api.app.get(SweeperService).tick();

    expect(await stats()).toEqual({ total: n, free: n, held: 0, allocated: 0 });
    expect((await api.get('/metrics')).body).toContain(`respool_expired_holds_total{pool="bulk"} ${n}`);
  });
});
