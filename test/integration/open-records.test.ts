import { afterAll, describe, expect, it } from 'vitest';
import { TestWorld, sleep } from '../support/harness.js';

/**
 * RESERVATION_RETENTION_MS is how long a closed reservation stays readable; an open one's record must last until
 * a sweep closes it, however short the retention (the config allows 1000 ms): the sweeper reads it to give the
 * items back and to lower the owner's count (HoldStore's OPEN_RECORD_MARGIN_MS).
 */
describe('open reservation records outlive a short retention', () => {
  const world = new TestWorld('revtasks', { RESERVATION_RETENTION_MS: '1000', IDEMPOTENCY_TTL_MS: '1000' });
  afterAll(() => world.cleanup());

  it('a lease that expires while the only instance restarts gives the reviewer its maxHoldsPerOwner quota back', async () => {
    const a = await world.start();
    expect((await a.post('/v1/pools', { name: 'quota', kind: 'task', holdTtlMs: 1000, maxHoldsPerOwner: 1 })).status).toBe(201);
    expect((await a.post('/v1/pools/quota/resources', { items: [{ value: 't1' }, { value: 't2' }, { value: 't3' }] })).status).toBe(201);
    const lease = await a.post('/v1/pools/quota/tasks/next', { reviewer: 'r-1' });
    expect(lease.status).toBe(200);

    // The only instance restarts (a deploy) and is back 3 s later; the lease expired meanwhile.
    await a.close();
    world.instances.splice(world.instances.indexOf(a), 1);
    await sleep(3000);
    const b = await world.start();

    // The expired lease's task is back (the start-up rebuild re-adds it) ...
    const others = [
      await b.post('/v1/pools/quota/tasks/next', { reviewer: 'r-2' }),
      await b.post('/v1/pools/quota/tasks/next', { reviewer: 'r-3' }),
    ];
    expect(others.map((o) => o.status)).toEqual([200, 200]);
    // ... and r-1 no longer counts as leasing it (its record gone before a sweep, it did for good: 429 OWNER_QUOTA_EXCEEDED).
    let last = await b.post('/v1/pools/quota/tasks/next', { reviewer: 'r-1' });
    for (const deadline = Date.now() + 4000; last.status !== 200 && Date.now() < deadline;) {
      await sleep(250);
      last = await b.post('/v1/pools/quota/tasks/next', { reviewer: 'r-1' });
    }
    expect(last.body?.error ?? null).toBeNull();
    expect(last.status).toBe(200);
  }, 20_000);
});
