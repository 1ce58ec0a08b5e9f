import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { DomainError } from '../../src/common/errors.js';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { CommitService } from '../../src/reservations/commit.service.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep } from '../support/harness.js';

const ids = (r: { body: { items: { resourceId: string }[] } }) => r.body.items.map((i) => i.resourceId);
/** Sleeps until `plusMs` after the reservation's expiresAt. */
const untilExpiry = (r: { body: { expiresAt: string } }, plusMs: number) =>
  sleep(Math.max(0, Date.parse(r.body.expiresAt) + plusMs - Date.now()));
const pgDown = () => Promise.reject(DomainError.unavailable('postgres', new Error('connect ECONNREFUSED 127.0.0.1:5432')));

// Invariant 4 for the items a confirm did not choose, when that confirm never ends: with the default commit window
// (15 s), they are free again within 2 s of expiresAt, not when the window ends.
describe('expiry of a reservation whose confirm never ended', () => {
  const world = new TestWorld('expiry-confirm');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    b = await world.start({ RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(() => world.cleanup());

  it('the items a confirm did not choose are free within 2 s of expiresAt when the confirming instance died after its pin', async () => {
    expect(a.config.COMMIT_WINDOW_MS).toBe(15_000);
    await seedPool(a, 'died-pin', numbers(2));
    const r = await a.post('/v1/pools/died-pin/reservations', { owner: 'buyer', count: 2, ttlMs: 1000 });
    expect(r.status).toBe(201);
    const [chosen, other] = ids(r);
    // Instance a takes the payment callback 200 ms before expiresAt, pins the chosen item for its commit and dies
    // before reaching Postgres.
    await untilExpiry(r, -200);
    expect((await a.app.get(HoldStore).pin('died-pin', r.body.id, [chosen], a.config.COMMIT_WINDOW_MS)).status).toBe('pinned');
    await untilExpiry(r, 2000);
    const next = await b.post('/v1/pools/died-pin/reservations', { owner: 'next', count: 1 });
    expect(next.status).toBe(201);
    expect(ids(next)).toEqual([other]);
    // The chosen item waits for Postgres' decision on the commit (the window's end).
    expect((await b.post('/v1/pools/died-pin/reservations', { owner: 'next', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');
  });

  it('the item it did choose comes back within 2 s of the end of its commit window, after the others came back earlier', async () => {
    await seedPool(a, 'died-pin-window', numbers(2, '1382000'));
    const r = await a.post('/v1/pools/died-pin-window/reservations', { owner: 'buyer', count: 2, ttlMs: 1000 });
    const [chosen, other] = ids(r);
    // A pin with a window of 2 s, 200 ms before expiresAt: the sweep first looks at it when the other item's hold
    // runs out (expiresAt + grace), then when the window ends, and the commit is then given up.
    await untilExpiry(r, -200);
    expect((await a.app.get(HoldStore).pin('died-pin-window', r.body.id, [chosen], 2000)).status).toBe('pinned');
    await untilExpiry(r, 1500);
    expect(ids(await b.post('/v1/pools/died-pin-window/reservations', { owner: 'next', count: 1 }))).toEqual([other]);
    await untilExpiry(r, 1800 + 2000);
    const again = await b.post('/v1/pools/died-pin-window/reservations', { owner: 'next', count: 1 });
    expect(again.status, JSON.stringify(again.body)).toBe(201);
    expect(ids(again)).toEqual([chosen]);
  });

  /**
   * A reservation of the 3 items of a new pool, held again: a confirm of its first item pinned it (epoch 1) with a
   * short window and its instance died; once the window was over, Postgres gave the epoch up while the hold was due.
   */
  async function heldAgain(pool: string, from: string, ttlMs: number) {
    await seedPool(a, pool, numbers(3, from));
    const r = await a.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count: 3, ttlMs });
    expect((await a.app.get(HoldStore).pin(pool, r.body.id, [ids(r)[0]], 300)).status).toBe('pinned');
    await sleep(400);
    const entity = await a.app.get(PoolRepository).findByName(pool);
    expect(await a.app.get(CommitService).recoverStalled(entity!, r.body.id)).toBe('held');
    expect((await a.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
    return r;
  }

  /** With Postgres down for every sweeper, 2 s after `r`'s expiry, someone else reserves all 3 items of `pool`. */
  async function allFreeWithoutPostgres(pool: string, r: { body: { expiresAt: string; items: { resourceId: string }[] } }) {
    const spies = [
      vi.spyOn(a.app.get(CommitService), 'recoverStalled').mockImplementation(pgDown),
      vi.spyOn(b.app.get(CommitService), 'recoverStalled').mockImplementation(pgDown),
    ];
    try {
      await untilExpiry(r, 2000);
      const next = await b.post(`/v1/pools/${pool}/reservations`, { owner: 'next', count: 3 });
      expect(next.status, JSON.stringify(next.body)).toBe(201);
      expect(ids(next).sort()).toEqual(ids(r).sort());
    } finally {
      for (const spy of spies) spy.mockRestore();
    }
  }

  it('with Postgres down at expiry, a reservation held again after its commit was given up frees all its items within 2 s', async () => {
    // Postgres has ended every epoch of it, so nothing needs to wait for it: all three are free again.
    await allFreeWithoutPostgres('held-again', await heldAgain('held-again', '1383000', 2000));
  });

  it('with Postgres down at expiry, a reservation held again by a confirm whose epoch Postgres ended frees all its items within 2 s', async () => {
    const r = await heldAgain('ended-unpin', '1385000', 2000);
    // The next confirm opens epoch 2; its commit times out, and Postgres ends the epoch (nothing landed): 503,
    // nothing was changed, held again.
    const timeout = vi
      .spyOn(a.app.get(ResourceRepository), 'allocate')
      .mockImplementation(() => Promise.reject(DomainError.unavailable('postgres', new Error('Query read timeout'))));
    try {
      const confirm = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [ids(r)[0]] });
      expect(confirm.status).toBe(503);
      expect(confirm.body.error.message).toMatch(/nothing was changed/);
    } finally {
      timeout.mockRestore();
    }
    expect((await a.app.get(HoldStore).read('ended-unpin', r.body.id))?.epoch).toBe(2);
    await allFreeWithoutPostgres('ended-unpin', r);
  });

  it('with Postgres down at expiry, once Postgres ended its epochs, an item only an earlier confirm chose is free within 2 s too', async () => {
    await seedPool(a, 'two-selections', numbers(3, '1387000'));
    const r = await a.post('/v1/pools/two-selections/reservations', { owner: 'buyer', count: 3, ttlMs: 2500 });
    const [first, second] = ids(r);
    const resources = a.app.get(ResourceRepository);
    const timeout = () => Promise.reject(DomainError.unavailable('postgres', new Error('Query read timeout')));
    const spies = [
      vi.spyOn(resources, 'allocate').mockImplementation(timeout),
      vi.spyOn(resources, 'decideAbort').mockImplementation(timeout),
    ];
    try {
      // A confirm of two items times out, and so does ending its epoch: the outcome is not known, both stay pinned.
      const unknown = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [first, second] });
      expect(unknown.body.error.details.outcome).toBe('unknown');
      // Postgres answers again, but for the commit: a confirm of one item times out, and Postgres ends both epochs.
      spies.pop()!.mockRestore();
      const ended = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [first] });
      expect(ended.body.error.message).toMatch(/nothing was changed/);
    } finally {
      for (const spy of spies) spy.mockRestore();
    }
    expect((await a.app.get(HoldStore).read('two-selections', r.body.id))?.epoch).toBe(2);
    await allFreeWithoutPostgres('two-selections', r);
  });

  it('a confirm whose epoch Postgres ended after the expiry closes it: a retry in the grace opens a new epoch, not that one', async () => {
    const r = await heldAgain('ended-late', '1388000', 1000);
    await untilExpiry(r, 100);
    const timeout = vi
      .spyOn(a.app.get(ResourceRepository), 'allocate')
      .mockImplementation(() => Promise.reject(DomainError.unavailable('postgres', new Error('Query read timeout'))));
    try {
      // In the grace: epoch 2 opens, its commit times out, and Postgres ends it: 503, nothing was changed.
      const confirm = await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [ids(r)[0]] });
      expect(confirm.body.error.message).toMatch(/nothing was changed/);
    } finally {
      timeout.mockRestore();
    }
    const retry = await a.app.get(HoldStore).pin('ended-late', r.body.id, [ids(r)[0]], a.config.COMMIT_WINDOW_MS);
    expect(retry.status).toBe('pinned');
    expect(retry.status === 'pinned' && [retry.opened, retry.reservation.epoch]).toEqual([true, 3]);
  });

  it('with Postgres down at expiry, a held-again reservation extended to a shorter hold frees its items within 2 s of the new expiry', async () => {
    const r = await heldAgain('held-again-shorter', '1386000', 6000);
    const extended = await a.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 1000 });
    expect(extended.status, JSON.stringify(extended.body)).toBe(200);
    // Well before the first expiry (6 s): the holds follow the new one.
    await allFreeWithoutPostgres('held-again-shorter', extended);
  });

  it('with Postgres down, a confirm that arrives in the grace, answered 503, does not keep the items it did not choose', async () => {
    await seedPool(a, 'grace-503', numbers(3, '1381000'));
    const r = await a.post('/v1/pools/grace-503/reservations', { owner: 'buyer', count: 3, ttlMs: 1000 });
    const [chosen, ...others] = ids(r);
    const spies = [
      vi.spyOn(a.app.get(ResourceRepository), 'allocate').mockImplementation(pgDown),
      vi.spyOn(a.app.get(ResourceRepository), 'decideAbort').mockImplementation(pgDown),
      vi.spyOn(a.app.get(CommitService), 'recoverStalled').mockImplementation(pgDown),
      vi.spyOn(b.app.get(CommitService), 'recoverStalled').mockImplementation(pgDown),
    ];
    try {
      // API.md: a confirm after expiry still succeeds for items nobody took; Postgres is down, so 503.
      await untilExpiry(r, 150);
      expect((await a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] })).status).toBe(503);
      await untilExpiry(r, 2000);
      const next = await b.post('/v1/pools/grace-503/reservations', { owner: 'next', count: 2 });
      expect(next.status, JSON.stringify(next.body)).toBe(201);
      expect(ids(next).sort()).toEqual([...others].sort());
    } finally {
      for (const spy of spies) spy.mockRestore();
    }
  });
});

// Invariant 4 while the instance whose sweep found a stalled commit runs a rebuild that takes seconds (of millions of
// items): the settling of that commit does not wait for it.
describe('the settling of a stalled commit during a long rebuild', () => {
  const world = new TestWorld('expiry-rebuild');
  afterAll(() => world.cleanup());

  it('the item a confirm that died chose is free within 2 s of the end of its commit window while the only instance rebuilds for 6 s', async () => {
    // The only instance (no other sweeps the pool), rebuilding as often as it can.
    const api = await world.start({ RECONCILE_INTERVAL_MS: '500' });
    onTestFinished(() => api.close());
    await seedPool(api, 'long-rebuild', numbers(1, '1383000'));
    const rebuilder = api.app.get(RebuildService);
    const rebuild = rebuilder.rebuild.bind(rebuilder);
    const slow = vi.spyOn(rebuilder, 'rebuild').mockImplementation(async (reason) => {
      if (reason === 'periodic') await sleep(6000);
      return rebuild(reason);
    });
    onTestFinished(() => slow.mockRestore());
    await eventually(async () => slow.mock.calls.some(([reason]) => reason === 'periodic'), 5000);
    const started = Date.now();

    const r = await api.post('/v1/pools/long-rebuild/reservations', { owner: 'buyer', count: 1, ttlMs: 1000 });
    const [chosen] = ids(r);
    await untilExpiry(r, -200);
    expect((await api.app.get(HoldStore).pin('long-rebuild', r.body.id, [chosen], 1500)).status).toBe('pinned');
    const windowEnd = Date.now() + 1500;
    await sleep(windowEnd + 2000 - Date.now());
    // (Still rebuilding.)
    expect(Date.now() - started).toBeLessThan(6000);
    const again = await api.post('/v1/pools/long-rebuild/reservations', { owner: 'next', count: 1 });
    expect(again.status, JSON.stringify(again.body)).toBe(201);
    expect(ids(again)).toEqual([chosen]);
  });
});
