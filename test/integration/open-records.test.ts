import { afterAll, describe, expect, it, vi } from 'vitest';
import { DomainError } from '../../src/common/errors.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { CommitService } from '../../src/reservations/commit.service.js';
import { TestWorld, eventually, numbers, seedPool, sleep } from '../support/harness.js';

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

describe('a reservation re-opened by a late confirm outlives a short retention', () => {
  const world = new TestWorld('reopened', { RESERVATION_RETENTION_MS: '1000', IDEMPOTENCY_TTL_MS: '1000' });
  afterAll(() => world.cleanup());

  it('its chosen item comes back once Postgres, down past the retention, settles the commit', async () => {
    // No periodic rebuild: only the sweeper can bring the item back. COMMIT_WINDOW_MS of 1 s: a sweep that could not
    // settle a commit (Postgres down) looks at it again 1 s later.
    const api = await world.start({ RECONCILE_INTERVAL_MS: '0', COMMIT_WINDOW_MS: '1000' });
    await seedPool(api, 'late', numbers(2, '1384000'));
    const r = await api.post('/v1/pools/late/reservations', { owner: 'buyer', count: 2, ttlMs: 1000 });
    const [chosen] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    // Swept: closed, both items free again, its record kept for the retention (1 s) only.
    await eventually(async () => (await api.stats('late')).free === 2, 5000);
    const down = vi
      .spyOn(api.app.get(CommitService), 'recoverStalled')
      .mockImplementation(() => Promise.reject(DomainError.unavailable('postgres', new Error('connect ECONNREFUSED'))));
    try {
      // A confirm arrives late (API.md: it still succeeds for items nobody took), takes the item back and pins it
      // (a commit window of 0.5 s), and its instance dies before Postgres; Postgres is down past the record's retention.
      expect((await api.app.get(HoldStore).pin('late', r.body.id, [chosen], 500)).status).toBe('pinned');
      await sleep(2500);
    } finally {
      down.mockRestore();
    }
    // Postgres is back: the sweeper settles the commit (given up) and both items are free.
    await eventually(async () => (await api.stats('late')).free === 2, 5000);
    const next = await api.post('/v1/pools/late/reservations', { owner: 'next', count: 2 });
    expect(next.status, JSON.stringify(next.body)).toBe(201);
  }, 20_000);
});
