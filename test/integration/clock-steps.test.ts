import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';
import { REDIS_URL, deleteKeys } from '../support/services.js';

/**
 * The wall clock of the instance's host steps (NTP, a VM resumed) while Redis and Postgres keep theirs: the instance
 * runs in this process, whose Date.now is stepped. Its intervals and deadlines are measured on a clock that does not
 * step; times other processes read come from Redis.
 */
describe('a step of the instance’s wall clock', () => {
  const world = new TestWorld('clock');
  let api: TestInstance;

  beforeAll(async () => {
    // Periodic rebuilds off: only the wipe check finds a wipe.
    api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
  });
  afterEach(() => {
    vi.restoreAllMocks();
  });
  afterAll(() => world.cleanup());

  /** From now on, the wall clock reads `by` ms off what it did. */
  const stepClock = (by: number) => {
    const now = Date.now.bind(Date);
    vi.spyOn(Date, 'now').mockImplementation(() => now() + by);
  };

  it('invariant 5: a wipe of Redis after the clock stepped back 30 s is still found at once (the wipe check was skipped for 30 s, and free items refused)', async () => {
    await seedPool(api, 'wipe-step', numbers(3));
    expect((await api.post('/v1/pools/wipe-step/reservations', { owner: 'o' })).status).toBe(201);
    stepClock(-30_000);
    await sleep(1000);
    await deleteKeys(REDIS_URL, world.prefix);
    const started = performance.now();
    let status = 0;
    while (performance.now() - started < 5000 && status !== 201) {
      await sleep(100);
      status = (await api.post('/v1/pools/wipe-step/reservations', { owner: 'o' })).status;
    }
    expect(status).toBe(201);
  });

  it('a reserve that waits is served when an item comes free within its waitMs, whichever way the clock steps meanwhile (a step forward ended the wait at once, 409; a step back made it sleep that long)', async () => {
    for (const by of [30_000, -20_000]) {
      const pool = `wait-step-${by > 0 ? 'fwd' : 'back'}`;
      await seedPool(api, pool, numbers(1));
      const holder = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'x' });
      expect(holder.status).toBe(201);
      const started = performance.now();
      const waiter = api.post(`/v1/pools/${pool}/reservations`, { owner: 'w', waitMs: 5000 });
      await sleep(300);
      stepClock(by);
      await sleep(700);
      expect((await api.del(`/v1/reservations/${holder.body.id}`)).status).toBe(200);
      const answer = await waiter;
      expect(answer.status, `clock stepped by ${by} ms`).toBe(201);
      expect(performance.now() - started).toBeLessThan(3000);
      vi.restoreAllMocks();
    }
  });
});
