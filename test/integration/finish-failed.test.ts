import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { DomainError } from '../../src/common/errors.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool } from '../support/harness.js';

// A confirm whose Postgres commit landed but whose Redis step (finish) failed is answered 200: the commit is
// durable. What reads and the pool then show must catch up at once, not when the commit window ends (15 s).
describe('a confirm answered 200 whose Redis step failed', () => {
  const world = new TestWorld('finish-failed');
  let a: TestInstance;
  let b: TestInstance;
  /** An instance whose sweeper (and upkeep) runs only every 10 s. */
  let slow: TestInstance;

  beforeAll(async () => {
    a = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    b = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    slow = await world.start({ RECONCILE_INTERVAL_MS: '0', SWEEP_INTERVAL_MS: '10000' });
  });
  afterAll(() => world.cleanup());

  /** Reserves 3 on `pool` (with an Idempotency-Key) and confirms the first on `on`, whose finish fails once. */
  async function confirmWithFailedFinish(on: TestInstance, pool: string) {
    await seedPool(on, pool, numbers(3));
    const r = await on.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count: 3 }, { 'Idempotency-Key': `order-${pool}` });
    const finish = vi
      .spyOn(on.app.get(HoldStore), 'finish')
      .mockRejectedValueOnce(DomainError.unavailable('redis', new Error('Connection is closed.')));
    try {
      const confirmed = await on.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      expect(confirmed.status).toBe(200);
      // (Called again already, perhaps: the instance's upkeep re-sends it within SWEEP_INTERVAL_MS.)
      expect(finish).toHaveBeenCalled();
      return { r, confirmed };
    } finally {
      finish.mockRestore();
    }
  }

  it('GET and a keyed replay say confirmed, with the allocation, and the items it released are free', async () => {
    // Confirmed on the slow instance, whose upkeep would send the Redis step again only 10 s later: the read on b
    // settles it.
    const { r, confirmed } = await confirmWithFailedFinish(slow, 'read-settles');
    const got = await b.get(`/v1/reservations/${r.body.id}`);
    expect(got.body.state).toBe('confirmed');
    expect(got.body.allocated).toEqual(confirmed.body.allocated);
    expect(got.body.released).toEqual(confirmed.body.released);
    expect(await b.stats('read-settles')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
    const replay = await b.post(
      '/v1/pools/read-settles/reservations',
      { owner: 'buyer', count: 3 },
      { 'Idempotency-Key': 'order-read-settles' },
    );
    expect([replay.status, replay.body.state]).toEqual([200, 'confirmed']);
  });

  it('a keyed replay alone settles it too', async () => {
    const { r } = await confirmWithFailedFinish(slow, 'replay-settles');
    const replay = await b.post(
      '/v1/pools/replay-settles/reservations',
      { owner: 'buyer', count: 3 },
      { 'Idempotency-Key': 'order-replay-settles' },
    );
    expect([replay.status, replay.body.id, replay.body.state]).toEqual([200, r.body.id, 'confirmed']);
    expect(await b.stats('replay-settles')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
  });

  it('with nobody reading it, the instance sends its Redis step again: the released items are free within 2 s', async () => {
    const { r } = await confirmWithFailedFinish(a, 'upkeep-settles');
    const { elapsedMs } = await eventually(async () => (await b.stats('upkeep-settles')).free === 2, 2000);
    expect(elapsedMs).toBeLessThan(2000);
    const stored = await b.app.get(HoldStore).read('upkeep-settles', r.body.id);
    expect(stored?.state).toBe('confirmed');
  });
});
