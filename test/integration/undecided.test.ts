import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import type { Redis } from 'ioredis';
import { HoldStore, toCachedItem } from '../../src/redis/hold-store.repository.js';
import { freeMember, poolKeys } from '../../src/redis/keys.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { CommitService } from '../../src/reservations/commit.service.js';
import { DomainError } from '../../src/common/errors.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm, staleReadAt } from '../support/harness.js';

/**
 * ResourceRepository.allocate as Postgres too slow for the commit window (1 s in the tests that use it) makes it:
 * the commit gets there after the sweeper gave its epoch up. Take it before spying on allocate.
 */
function afterItsWindow(resources: ResourceRepository): ResourceRepository['allocate'] {
  const allocate = resources.allocate.bind(resources);
  return async (allocation) => {
    await sleep(1200);
    await resources.decideAbort(allocation.reservationId, allocation.epoch);
    return allocate(allocation);
  };
}

/** A promise the test resolves when it chooses: `open()` lets whatever awaits `opened` go on. */
function gate(): { opened: Promise<void>; open: () => void } {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => (open = resolve));
  return { opened, open };
}

/**
 * Makes the instance's next pin answer 400 ms late, after its Redis timeout (start it with REDIS_TIMEOUT_MS below
 * that): HoldStore then sends the pin again. Returns how many times the pin was sent so far. (ioredis calls the
 * command once more on its auto-pipeline: only the caller's calls are counted and delayed.)
 */
function pinAnsweredLate(instance: TestInstance): () => number {
  const redis = instance.app.get<Redis>(REDIS) as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  const pin = redis.rp_pin;
  let sends = 0;
  vi.spyOn(redis, 'rp_pin').mockImplementation(function (this: unknown, ...args: unknown[]) {
    if (this !== redis) return pin.apply(this, args);
    sends++;
    const answer = pin.apply(this, args);
    return sends === 1 ? sleep(400).then(() => answer) : answer;
  });
  return () => sends;
}

// Invariants 1 and 3 when a commit landed in Postgres but its caller never saw the answer (the instance
// died after the commit, or the connection dropped): its items stay out of the pool until Postgres'
// decision is applied. A slow sweeper (10 s) leaves the tests the gap in which things used to go wrong.
describe('commits whose outcome the caller never saw', () => {
  const world = new TestWorld('undecided');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start({ SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(() => world.cleanup());

  it('an item committed by an instance that died before finishing is not put back by a rebuild page read before the commit', async () => {
    await seedPool(api, 'died', numbers(1));
    const r = await api.post('/v1/pools/died/reservations', { owner: 'buyer', count: 1, ttlMs: 1000 });
    const id = r.body.items[0].resourceId;
    // Confirmed close to its expiry: the commit window (1.2 s) outlasts the hold's own time.
    const confirm = await stalledConfirm(api, 'died', r.body.id, id, 1200);
    // A rebuild reads its page now: the item is free in Postgres.
    const pool = await api.app.get(PoolRepository).findByName('died');
    const readAt = await api.app.get(HoldStore).clock();
    const page = await api.app.get(ResourceRepository).freePage(pool!.id, '0', 100);
    const generation = await api.app.get(GenerationRepository).current();
    // The commit lands; the instance that made it dies before its Redis step. The commit window passes
    // (the sweeper, every 10 s here, has not looked at it yet).
    expect(await confirm.land()).toBe('committed');
    await sleep(1500);
    // The page is written late: the pinned hold must still be there to keep the item out.
    expect(await api.app.get(HoldStore).addFree('died', generation, readAt, page.map(toCachedItem))).toBe(0);
    const again = await api.post('/v1/pools/died/reservations', { owner: 'next', count: 1 });
    expect(again.body.error?.code).toBe('POOL_EXHAUSTED');
  });

  it('an abort whose Postgres read is too old (its instance stalled after the read) changes nothing', async () => {
    await seedPool(api, 'old-abort', numbers(2));
    const r = await api.post('/v1/pools/old-abort/reservations', { owner: 'o', count: 1 });
    const id = r.body.items[0].resourceId;
    const holds = api.app.get(HoldStore);
    const pin = await holds.pin('old-abort', r.body.id, [id], 5000);
    if (pin.status !== 'pinned') throw new Error(`pin: ${pin.status}`);
    const epoch = pin.reservation.epoch;
    // Postgres said the item moved on to version 7, in a read older than the fence allows: Redis takes none of it.
    const moved = { id, v: r.body.items[0].value, n: 7 };
    const old = staleReadAt(await holds.clock());
    expect(await holds.abort('old-abort', r.body.id, epoch, old, [], [moved])).toBe('tooOld');
    expect((await holds.read('old-abort', r.body.id))?.state).toBe('confirming');
    expect(await holds.holder('old-abort', id)).toBe(r.body.id);
    // The same answer, read just now, settles it.
    expect(await holds.abort('old-abort', r.body.id, epoch, await holds.clock(), [], [moved])).toBe('expired');
    expect((await holds.read('old-abort', r.body.id))?.state).toBe('expired');
  });

  it('a reservation released after a confirm whose commit landed unseen is confirmed, not released', async () => {
    await seedPool(api, 'unseen', numbers(2));
    const r = await api.post('/v1/pools/unseen/reservations', { owner: 'buyer', count: 2 });
    const [chosen, other] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    const confirm = await stalledConfirm(api, 'unseen', r.body.id, chosen, 200);
    expect(await confirm.land()).toBe('committed');
    // The confirm's caller saw an error (a timeout), so the reservation was un-pinned: held again.
    expect(await api.app.get(HoldStore).unpin('unseen', confirm.pinned)).toBe(true);
    const released = await api.del(`/v1/reservations/${r.body.id}`);
    expect(released.status).toBe(409);
    expect(released.body.error.code).toBe('RESERVATION_CLOSED');
    // Only the unchosen item is free again; the committed one never comes back.
    const next = await api.post('/v1/pools/unseen/reservations', { owner: 'next', count: 1 });
    expect(next.body.items[0].resourceId).toBe(other);
    expect((await api.post('/v1/pools/unseen/reservations', { owner: 'next', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');
    expect(await world.query(`SELECT state, owner FROM t_resource WHERE id = $1`, [chosen])).toEqual([{ state: 2, owner: 'buyer' }]);
  });

  it('a reservation released after a confirm that never reached Postgres is released, and that commit can no longer land', async () => {
    await seedPool(api, 'never', numbers(1));
    const r = await api.post('/v1/pools/never/reservations', { owner: 'buyer', count: 1 });
    const id = r.body.items[0].resourceId;
    const confirm = await stalledConfirm(api, 'never', r.body.id, id, 200);
    expect(await api.app.get(HoldStore).unpin('never', confirm.pinned)).toBe(true);
    expect((await api.del(`/v1/reservations/${r.body.id}`)).status).toBe(200);
    // The lost commit arrives after the release: its epoch was given up.
    expect(await confirm.land()).toBe('decided');
    expect((await api.post('/v1/pools/never/reservations', { owner: 'next', count: 1 })).status).toBe(201);
    expect(await world.query(`SELECT state FROM t_resource WHERE id = $1`, [id])).toEqual([{ state: 1 }]);
  });

  it('an item whose owner released it before a sweeper finished its commit goes back to the pool', async () => {
    await seedPool(api, 'released-first', numbers(1));
    const r = await api.post('/v1/pools/released-first/reservations', { owner: 'buyer', count: 1 });
    const id = r.body.items[0].resourceId;
    // The commit lands; its Redis step is lost (Redis failed just then); the buyer was answered 200 and
    // releases the number before any sweeper has finished the commit. The release finishes it.
    const confirm = await stalledConfirm(api, 'released-first', r.body.id, id, 200);
    expect(await confirm.land()).toBe('committed');
    expect((await api.post(`/v1/pools/released-first/resources/${id}/release`, { owner: 'buyer' })).status).toBe(200);
    const again = await api.post('/v1/pools/released-first/reservations', { owner: 'next', count: 1 });
    expect(again.body.items?.[0]?.resourceId).toBe(id);
    const pool = await api.app.get(PoolRepository).findByName('released-first');
    await sleep(300); // the commit window passes: the sweeper finds nothing left to do
    expect(await api.app.get(CommitService).recoverStalled(pool!, r.body.id)).toBe('gone');

    // When the release cannot finish it either (Redis failed again), the sweeper does, once the window is over.
    await seedPool(api, 'released-first-2', numbers(1, '1390000'));
    const r2 = await api.post('/v1/pools/released-first-2/reservations', { owner: 'buyer', count: 1 });
    const id2 = r2.body.items[0].resourceId;
    const confirm2 = await stalledConfirm(api, 'released-first-2', r2.body.id, id2, 200);
    expect(await confirm2.land()).toBe('committed');
    const finish = vi.spyOn(api.app.get(HoldStore), 'finish').mockRejectedValueOnce(new Error('Command timed out'));
    try {
      expect((await api.post(`/v1/pools/released-first-2/resources/${id2}/release`, { owner: 'buyer' })).status).toBe(200);
      expect(finish).toHaveBeenCalled();
    } finally {
      finish.mockRestore();
    }
    await sleep(300);
    const pool2 = await api.app.get(PoolRepository).findByName('released-first-2');
    expect(await api.app.get(CommitService).recoverStalled(pool2!, r2.body.id)).toBe('finished');
    const again2 = await api.post('/v1/pools/released-first-2/reservations', { owner: 'next', count: 1 });
    expect(again2.body.items?.[0]?.resourceId).toBe(id2);
  });

  it('a confirm retried after a stalled commit window succeeds while the sweeper is settling that commit', async () => {
    await seedPool(api, 'retried', numbers(1));
    const r = await api.post('/v1/pools/retried/reservations', { owner: 'buyer', count: 1, ttlMs: 60_000 });
    const chosen = r.body.items[0].resourceId;
    // The first confirm's instance dies after pinning; its window (200 ms) passes.
    const first = await stalledConfirm(api, 'retried', r.body.id, chosen, 200);
    await sleep(300);
    // The sweeper has found it and given its epoch up in Postgres, but not yet in Redis...
    expect(await api.app.get(ResourceRepository).decideAbort(r.body.id, first.pinned.reservation.epoch)).toBe('abort');
    // ...when the buyer's retry pins the hold (still due) again, and stalls before its commit.
    const retry = await stalledConfirm(api, 'retried', r.body.id, chosen, 5000);
    expect(retry.pinned.reservation.epoch).toBe(first.pinned.reservation.epoch + 1);
    // The sweeper goes on with the reservation it found: it must leave the retry's live epoch alone.
    const pool = await api.app.get(PoolRepository).findByName('retried');
    expect(await api.app.get(CommitService).recoverStalled(pool!, r.body.id)).toBe('held');
    expect(await retry.land()).toBe('committed');
    expect(await first.land()).toBe('decided');
    // The same race through the API: a confirm arriving after a window that the sweeper has given up.
    await seedPool(api, 'retried-api', numbers(1, '1390000'));
    const r2 = await api.post('/v1/pools/retried-api/reservations', { owner: 'buyer2', count: 1, ttlMs: 60_000 });
    const other = r2.body.items[0].resourceId;
    const stalled = await stalledConfirm(api, 'retried-api', r2.body.id, other, 200);
    await sleep(300);
    expect(await api.app.get(ResourceRepository).decideAbort(r2.body.id, stalled.pinned.reservation.epoch)).toBe('abort');
    const confirmed = await api.post(`/v1/reservations/${r2.body.id}/confirm`, { resourceIds: [other] });
    expect(confirmed.status, JSON.stringify(confirmed.body)).toBe(200);
    expect(
      await world.query(`SELECT id::text, owner FROM t_resource WHERE state = 2 AND id IN ($1, $2) ORDER BY owner`, [chosen, other]),
    ).toEqual([
      { id: chosen, owner: 'buyer' },
      { id: other, owner: 'buyer2' },
    ]);
  });

  /**
   * A reservation of 3 items held for `ttlMs`, whose confirm of one is answered 503 with its outcome unknown while
   * Postgres answers nothing: the commit (and its retry) time out, so it may have landed; neither ending its epoch nor
   * the sweeper's settling of it gets an answer. (A commit that surely never reached Postgres changes nothing at all:
   * recovery.test.ts.) `whileHeld` then returns the reservation's expiresAt (extend may move it). The two items the
   * confirm did not choose must be free within 2 s of it; the chosen one waits for Postgres, and is free once it is back.
   */
  async function unchosenFreeWithPostgresDown(
    pool: string,
    ttlMs: number,
    whileHeld: (instance: TestInstance, id: string, expiresAt: string) => Promise<string>,
  ) {
    const quick = await world.start({ COMMIT_WINDOW_MS: '1000', RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, pool, numbers(3, '1391000'));
      const r = await quick.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count: 3, ttlMs });
      const [chosen, ...others] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
      const down = () => Promise.reject(DomainError.unavailable('postgres', new Error('Query read timeout')));
      const allocate = vi.spyOn(quick.app.get(ResourceRepository), 'allocate').mockImplementation(down);
      const decide = vi.spyOn(quick.app.get(ResourceRepository), 'decideAbort').mockImplementation(down);
      const settle = vi.spyOn(quick.app.get(CommitService), 'recoverStalled').mockImplementation(down);
      try {
        const confirm = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
        expect(confirm.status).toBe(503);
        expect(confirm.body.error.details.outcome).toBe('unknown');
        const expiresAt = await whileHeld(quick, r.body.id, r.body.expiresAt);
        await sleep(Math.max(0, Date.parse(expiresAt) - Date.now()) + 2000);
        const next = await quick.post(`/v1/pools/${pool}/reservations`, { owner: 'next', count: 2 });
        expect(next.status, JSON.stringify(next.body)).toBe(201);
        expect(next.body.items.map((i: { resourceId: string }) => i.resourceId).sort()).toEqual([...others].sort());
        expect((await quick.post(`/v1/pools/${pool}/reservations`, { owner: 'third', count: 1 })).status).toBe(409);
      } finally {
        allocate.mockRestore();
        decide.mockRestore();
        settle.mockRestore();
      }
      // Postgres back: the sweeper settles the commit, which never landed, and the chosen item is free too.
      await eventually(async () => (await quick.post(`/v1/pools/${pool}/reservations`, { owner: 'third', count: 1 })).status === 201, 5000);
    } finally {
      // Its sweeper runs every 100 ms: it must not sweep the pools of the tests after this one.
      await quick.close();
    }
  }

  it('invariant 4 with Postgres down: the items a confirm answered 503 did not choose are free within 2 s of the expiry', async () => {
    await unchosenFreeWithPostgresDown('pg-down-flow', 1000, async (_, __, expiresAt) => expiresAt);
  });

  it('invariant 4 with Postgres down: after an extend that shortened the hold, the items not chosen are free within 2 s of the new expiry', async () => {
    await unchosenFreeWithPostgresDown('pg-down-shorter', 30_000, async (instance, id) => {
      // Held again, its commit undecided: the buyer shortens the hold to 1 s. Its two other items come back with the
      // shortened hold, not 30 s on.
      const extended = await instance.post(`/v1/reservations/${id}/extend`, { ttlMs: 1000 });
      expect(extended.status).toBe(200);
      return extended.body.expiresAt as string;
    });
  });

  it('an extend that shortens the hold leaves the holds of every item an undecided epoch chose (two selections) pinned', async () => {
    await seedPool(api, 'shorter-two-epochs', numbers(3, '1393000'));
    const r = await api.post('/v1/pools/shorter-two-epochs/reservations', { owner: 'buyer', count: 3, ttlMs: 60_000 });
    const [first, second, other] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    const holds = api.app.get(HoldStore);
    // Two confirms of other selections, each failing with its outcome unknown (may have landed): two undecided epochs.
    for (const chosen of [first, second]) {
      const pinned = await holds.pin('shorter-two-epochs', r.body.id, [chosen], 15_000);
      expect(pinned).toMatchObject({ status: 'pinned', opened: true });
      if (pinned.status === 'pinned') expect(await holds.unpin('shorter-two-epochs', pinned)).toBe(true);
    }
    expect((await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 1000 })).status).toBe(200);
    const client = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'shorter-two-epochs');
    const ttls = await Promise.all([first, second, other].map((id) => client.pttl(keys.hold(id))));
    expect(ttls[0]).toBeGreaterThan(60_000);
    expect(ttls[1]).toBeGreaterThan(60_000);
    expect(ttls[2]).toBeLessThanOrEqual(1000 + api.config.HOLD_GRACE_MS);
  });

  it('a confirm inside its hold whose commit outlasted its window (Postgres slow, the sweeper gave it up) commits in a new epoch: 200', async () => {
    const quick = await world.start({ COMMIT_WINDOW_MS: '1000', RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, 'slow-commit', numbers(2, '1392000'));
      const r = await quick.post('/v1/pools/slow-commit/reservations', { owner: 'buyer', count: 2, ttlMs: 60_000 });
      const chosen = r.body.items[0].resourceId;
      const resources = quick.app.get(ResourceRepository);
      // The first commit reaches Postgres after its window, once the sweeper has decided to give its epoch up.
      const late = afterItsWindow(resources);
      const slow = vi.spyOn(resources, 'allocate').mockImplementationOnce(late);
      try {
        const confirmed = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
        expect(confirmed.status, JSON.stringify(confirmed.body)).toBe(200);
        expect(slow).toHaveBeenCalledTimes(2);
      } finally {
        slow.mockRestore();
      }
      expect(await world.query(`SELECT owner, state FROM t_resource WHERE id = $1`, [chosen])).toEqual([{ owner: 'buyer', state: 2 }]);
      expect(
        await world.query(`SELECT epoch, decision FROM t_commit_decision WHERE reservation_id = $1 ORDER BY epoch`, [r.body.id]),
      ).toEqual([
        { epoch: 1, decision: 'abort' },
        { epoch: 2, decision: 'commit' },
      ]);
    } finally {
      // Its sweeper runs every 100 ms: it must not sweep the pools of the tests after this one.
      await quick.close();
    }
  });

  it('a confirm whose commit outlasted its window twice answers 503 (nothing allocated), and its retry inside the hold succeeds', async () => {
    const quick = await world.start({ COMMIT_WINDOW_MS: '1000', RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, 'slower-commit', numbers(2, '1393000'));
      const r = await quick.post('/v1/pools/slower-commit/reservations', { owner: 'buyer', count: 2, ttlMs: 60_000 });
      const chosen = r.body.items[0].resourceId;
      const resources = quick.app.get(ResourceRepository);
      // Both commits reach Postgres after their windows, once their epochs were given up.
      const late = afterItsWindow(resources);
      const slow = vi.spyOn(resources, 'allocate').mockImplementationOnce(late).mockImplementationOnce(late);
      try {
        const refused = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
        expect(refused.status, JSON.stringify(refused.body)).toBe(503);
        expect(refused.body.error).toMatchObject({ code: 'DEPENDENCY_UNAVAILABLE', details: { dependency: 'postgres' } });
        expect(slow).toHaveBeenCalledTimes(2);
      } finally {
        slow.mockRestore();
      }
      expect(await world.query(`SELECT state FROM t_resource WHERE id = $1`, [chosen])).toEqual([{ state: 1 }]);
      const retried = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
      expect(retried.status, JSON.stringify(retried.body)).toBe(200);
      expect(await world.query(`SELECT owner, state FROM t_resource WHERE id = $1`, [chosen])).toEqual([{ owner: 'buyer', state: 2 }]);
    } finally {
      await quick.close();
    }
  });

  it('the one more try of a commit given up does not join the epoch a retry opened since: that retry failing cannot end it', async () => {
    const quick = await world.start({ COMMIT_WINDOW_MS: '1000', RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, 'retry-opened', numbers(2, '1394000'));
      const r = await quick.post('/v1/pools/retry-opened/reservations', { owner: 'buyer', count: 2, ttlMs: 60_000 });
      const chosen = r.body.items[0].resourceId;
      const pool = (await quick.app.get(PoolRepository).findByName('retry-opened'))!;
      const holds = quick.app.get(HoldStore);
      const resources = quick.app.get(ResourceRepository);
      const allocate = resources.allocate.bind(resources);
      let retryEpoch = 0;
      const epochs: number[] = [];
      const slow = vi
        .spyOn(resources, 'allocate')
        // The first commit outlasts its window: the sweeper gives epoch 1 up (held again), and the caller's retry,
        // on another instance, pins and opens epoch 2 before the late commit is refused.
        .mockImplementationOnce(async (allocation) => {
          epochs.push(allocation.epoch);
          await sleep(1100);
          await quick.app.get(CommitService).recoverStalled(pool, r.body.id);
          const retry = await holds.pin('retry-opened', r.body.id, [chosen], 1000);
          if (retry.status !== 'pinned') throw new Error(`retry pin: ${retry.status}`);
          retryEpoch = retry.reservation.epoch;
          return allocate(allocation);
        })
        // The retry's commit fails and it ends its epoch; then the one more try of the first commit reaches Postgres.
        .mockImplementationOnce(async (allocation) => {
          epochs.push(allocation.epoch);
          await resources.decideAbort(r.body.id, retryEpoch);
          return allocate(allocation);
        });
      try {
        const confirmed = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
        expect(confirmed.status, JSON.stringify(confirmed.body)).toBe(200);
        expect(retryEpoch).toBe(2);
        expect(epochs).toEqual([1, 3]);
      } finally {
        slow.mockRestore();
      }
      expect(await world.query(`SELECT owner, state FROM t_resource WHERE id = $1`, [chosen])).toEqual([{ owner: 'buyer', state: 2 }]);
    } finally {
      await quick.close();
    }
  });

  it('once Postgres has ended its last epoch, a reservation held again is released, and expires, with Postgres down', async () => {
    const quick = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, 'ended-then-down', numbers(4, '1395000'), { maxHoldsPerOwner: 2 });
      const reserve = (ttlMs: number) => quick.post('/v1/pools/ended-then-down/reservations', { owner: 'buyer', count: 2, ttlMs });
      const resources = quick.app.get(ResourceRepository);
      const redis = quick.app.get<Redis>(REDIS);
      const rkey = (id: string) => `${poolKeys(world.prefix, 'ended-then-down').base}r:${id}`;
      // A confirm whose instance died after its pin: at the end of its window the sweeper asks Postgres, which ends
      // the epoch, and holds the reservation again (its hold still due), the epoch recorded as ended ('ad').
      const endedAfterPin = async (r: { body: { id: string; items: { resourceId: string }[] } }) => {
        await stalledConfirm(quick, 'ended-then-down', r.body.id, r.body.items[0].resourceId, 200);
        await eventually(async () => {
          const [state, epoch, ended] = await redis.hmget(rkey(r.body.id), 's', 'ep', 'ad');
          return state === 'held' && epoch === '1' && ended === '1';
        }, 3000);
      };
      const down = () => Promise.reject(DomainError.unavailable('postgres', new Error('connect ECONNREFUSED')));
      const postgresDown = () => [
        vi.spyOn(resources, 'decideAbort').mockImplementation(down),
        vi.spyOn(resources, 'findMany').mockImplementation(down),
      ];
      const first = await reserve(60_000);
      await endedAfterPin(first);
      let spies = postgresDown();
      try {
        const released = await quick.del(`/v1/reservations/${first.body.id}`);
        expect(released.status, JSON.stringify(released.body)).toBe(200);
        expect(released.body.state).toBe('released');
        for (const spy of spies) spy.mockRestore();
        const second = await reserve(1500);
        await endedAfterPin(second);
        spies = postgresDown();
        // At its expiry its holds end and its owner's quota is given back, without Postgres.
        await sleep(Math.max(0, Date.parse(second.body.expiresAt) - Date.now()) + 1500);
        expect(await redis.hget(rkey(second.body.id), 's')).toBe('expired');
        const again = await reserve(60_000);
        expect(again.status, JSON.stringify(again.body)).toBe(201);
      } finally {
        for (const spy of spies) spy.mockRestore();
      }
    } finally {
      await quick.close();
    }
  });

  it('a confirm in a later epoch that fails past the expiry, its epoch ended, leaves a plain expiry: no wait for Postgres', async () => {
    const quick = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    try {
      await seedPool(quick, 'ended-late', numbers(4, '1396000'), { maxHoldsPerOwner: 2 });
      const r = await quick.post('/v1/pools/ended-late/reservations', { owner: 'buyer', count: 2, ttlMs: 1500 });
      const chosen = r.body.items[0].resourceId;
      const resources = quick.app.get(ResourceRepository);
      const redis = quick.app.get<Redis>(REDIS);
      const rkey = `${poolKeys(world.prefix, 'ended-late').base}r:${r.body.id}`;
      // Epoch 1: its instance died after the pin; the sweeper ended it, and the reservation is held again.
      await stalledConfirm(quick, 'ended-late', r.body.id, chosen, 200);
      await eventually(async () => (await redis.hmget(rkey, 's', 'ad')).join() === 'held,1', 3000);
      // Epoch 2: its commit's answer is lost after the expiry; the confirm ends the epoch in Postgres, then 503.
      const expiresAt = Date.parse(r.body.expiresAt);
      const lost = vi.spyOn(resources, 'allocate').mockImplementation(async () => {
        await sleep(Math.max(0, expiresAt - Date.now()) + 100);
        throw DomainError.unavailable('postgres', new Error('Query read timeout'));
      });
      try {
        const confirm = await quick.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] });
        expect([confirm.status, confirm.body.error.details.outcome]).toEqual([503, undefined]);
      } finally {
        lost.mockRestore();
      }
      expect(await redis.hmget(rkey, 'ep', 'ad')).toEqual(['2', '2']);
      // Postgres down: the expiry frees the items and gives the owner's quota back all the same.
      const down = () => Promise.reject(DomainError.unavailable('postgres', new Error('connect ECONNREFUSED')));
      const spies = [vi.spyOn(resources, 'decideAbort').mockImplementation(down), vi.spyOn(resources, 'findMany').mockImplementation(down)];
      try {
        await sleep(Math.max(0, expiresAt - Date.now()) + 1500);
        expect(await redis.hget(rkey, 's')).toBe('expired');
        const again = await quick.post('/v1/pools/ended-late/reservations', { owner: 'buyer', count: 2 });
        expect(again.status, JSON.stringify(again.body)).toBe(201);
      } finally {
        for (const spy of spies) spy.mockRestore();
      }
    } finally {
      await quick.close();
    }
  });

  it('a confirm that joined a commit keeps it when the other confirm of that commit fails and un-pins', async () => {
    await seedPool(api, 'joined', numbers(1));
    const r = await api.post('/v1/pools/joined/reservations', { owner: 'buyer', count: 1, ttlMs: 1000 });
    const id = r.body.items[0].resourceId;
    // The payment system's retry reaches a second instance while the first confirm is committing.
    const first = await stalledConfirm(api, 'joined', r.body.id, id, 5000);
    await sleep(5);
    const second = await stalledConfirm(api, 'joined', r.body.id, id, 5000);
    expect(second.pinned.reservation.epoch).toBe(first.pinned.reservation.epoch);
    // The first one's Postgres call fails: it must not end the window the second one still commits in.
    expect(await api.app.get(HoldStore).unpin('joined', first.pinned)).toBe(false);
    await sleep(1100); // past the hold's expiry: a sweeper looking now must leave the commit alone
    const pool = await api.app.get(PoolRepository).findByName('joined');
    expect(await api.app.get(CommitService).recoverStalled(pool!, r.body.id)).toBe('held');
    expect(await second.land()).toBe('committed');
  });

  it('an un-pin sent twice (HoldStore retries a Redis timeout) leaves alone a pin that came after its first run, whatever the clock did', async () => {
    await seedPool(api, 'unpin-twice', numbers(1));
    const r = await api.post('/v1/pools/unpin-twice/reservations', { owner: 'buyer', count: 1, ttlMs: 60_000 });
    const id = r.body.items[0].resourceId;
    const holds = api.app.get(HoldStore);
    // A confirm whose commit surely never reached Postgres: its un-pin puts the reservation back with no epoch.
    const first = await stalledConfirm(api, 'unpin-twice', r.body.id, id, 5000);
    expect(await holds.unpin('unpin-twice', first.pinned, true)).toBe(true);
    // The payment system's retry pins it again, in epoch 1 once more, and commits. Redis' clock had gone back
    // meanwhile: this pin's window ends when the first one's did.
    const second = await stalledConfirm(api, 'unpin-twice', r.body.id, id, 5000);
    expect(second.pinned.reservation.epoch).toBe(first.pinned.reservation.epoch);
    const record = poolKeys(world.prefix, 'unpin-twice').reservation(r.body.id);
    await api.app.get<Redis>(REDIS).hset(record, 'pw', String(first.pinned.reservation.pinnedUntilMs));
    // The first un-pin's reply was lost to a timeout, and it was sent again: it must not take the second pin apart.
    expect(await holds.unpin('unpin-twice', first.pinned, true)).toBe(false);
    expect(await api.app.get<Redis>(REDIS).hmget(record, 's', 'ep')).toEqual(['confirming', '1']);
    expect(await second.land()).toBe('committed');
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    expect((await api.post('/v1/pools/unpin-twice/reservations', { owner: 'rival', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');
  });

  it('a confirm with another selection does not join a commit that a version conflict is giving up', async () => {
    await seedPool(api, 'reselect', numbers(2));
    const r = await api.post('/v1/pools/reselect/reservations', { owner: 'buyer', count: 2, ttlMs: 60_000 });
    const [x, y] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    const first = await stalledConfirm(api, 'reselect', r.body.id, x, 5000);
    // The first confirm met a version conflict on x: Postgres gives its epoch up...
    expect(await api.app.get(ResourceRepository).decideAbort(r.body.id, first.pinned.reservation.epoch)).toBe('abort');
    // ...and before Redis hears of it, the buyer confirms the other number.
    const second = await stalledConfirm(api, 'reselect', r.body.id, y, 5000);
    expect(second.pinned.reservation.epoch).toBe(first.pinned.reservation.epoch + 1);
    expect(await second.land()).toBe('committed');
  });

  describe('a confirm whose commit got no answer (a timeout, a lost connection)', () => {
    const lost = (cause: Error) => Promise.reject(DomainError.unavailable('postgres', cause));

    it('landed all the same: answered 200 with the commit, not 503 "nothing was changed"', async () => {
      await seedPool(api, 'lost-answer', numbers(3));
      const r = await api.post('/v1/pools/lost-answer/reservations', { owner: 'buyer', count: 3 });
      const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
      const resources = api.app.get(ResourceRepository);
      const allocate = resources.allocate.bind(resources);
      // The commit lands; its answer is lost with the connection, twice (the retry joins the same epoch).
      const spy = vi
        .spyOn(resources, 'allocate')
        .mockImplementation(async (a) => (await allocate(a), lost(new Error('Connection terminated unexpectedly'))));
      let confirmed;
      try {
        confirmed = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] });
      } finally {
        spy.mockRestore();
      }
      expect(confirmed.status, JSON.stringify(confirmed.body)).toBe(200);
      expect(confirmed.body.allocated.map((i: { resourceId: string }) => i.resourceId)).toEqual([x]);
      expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('confirmed');
      expect(await api.stats('lost-answer')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
    });

    it('did not land: 503 "nothing was changed" is true, and the epoch can no longer land; a retry choosing another item succeeds', async () => {
      await seedPool(api, 'not-landed', numbers(3, '1390000'));
      const r = await api.post('/v1/pools/not-landed/reservations', { owner: 'buyer', count: 3 });
      const [x, y] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
      const spy = vi.spyOn(api.app.get(ResourceRepository), 'allocate').mockImplementation(() => lost(new Error('Query read timeout')));
      let first;
      try {
        first = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] });
      } finally {
        spy.mockRestore();
      }
      expect(first.status).toBe(503);
      expect(first.body.error.message).toMatch(/nothing was changed/);
      expect(first.body.error.details.outcome).toBeUndefined();
      // Postgres recorded the epoch as given up: the attempt, were it still on its way, would be refused.
      const [{ decision }] = await world.query(`SELECT decision FROM t_commit_decision WHERE reservation_id = $1`, [r.body.id]);
      expect(decision).toBe('abort');
      expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
      const retry = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [y] });
      expect(retry.status).toBe(200);
      expect(await api.stats('not-landed')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
    });

    it('gives its epoch up before answering 503, yet the same confirm that joined the epoch on another instance succeeds', async () => {
      // The payment system's retry of a confirm reaches instance b while a's commit hangs: b joins a's epoch. a gets no
      // answer and ends the epoch in Postgres before b's commit gets there (it waited for a batch slot).
      const b = await world.start({ SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
      try {
        await seedPool(api, 'joined-then-ended', numbers(3, '1392000'));
        const r = await api.post('/v1/pools/joined-then-ended/reservations', { owner: 'buyer', count: 3 });
        const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
        const path = `/v1/reservations/${r.body.id}/confirm`;
        const aGate = gate();
        const aAllocate = vi.spyOn(api.app.get(ResourceRepository), 'allocate').mockImplementation(async () => {
          await aGate.opened;
          return lost(new Error('Query read timeout'));
        });
        const aDone = gate();
        const bResources = b.app.get(ResourceRepository);
        const allocate = bResources.allocate.bind(bResources);
        const bAllocate = vi
          .spyOn(bResources, 'allocate')
          .mockImplementation(async (allocation) => (await aDone.opened, allocate(allocation)));
        try {
          const first = api.post(path, { resourceIds: [x] });
          await sleep(200);
          const second = b.post(path, { resourceIds: [x] });
          await sleep(200);
          const stored = await b.app.get(HoldStore).read('joined-then-ended', r.body.id);
          expect([stored?.state, stored?.epoch]).toEqual(['confirming', 1]); // b joined epoch 1
          aGate.open();
          const answerA = await first;
          aDone.open();
          const answerB = await second;
          expect(answerA.status).toBe(503); // and true: Postgres ended epoch 1 before anything landed in it
          // b's confirm arrived long before expiresAt, its hold intact: API.md says it succeeds.
          expect(answerB.status, JSON.stringify(answerB.body)).toBe(200);
        } finally {
          // Should an expectation fail first, the held-up commits still end, and the instances can close.
          aGate.open();
          aDone.open();
          aAllocate.mockRestore();
          bAllocate.mockRestore();
        }
        expect(await api.stats('joined-then-ended')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
      } finally {
        await b.close();
      }
    });

    for (const [pool, pinSentTwice, from] of [
      ['joiner-fails', false, '1393000'],
      ['joiner-fails-twice', true, '1397000'],
    ] as const) {
      it(`one that joined the epoch of an attempt still committing leaves that epoch alone: 503 outcome unknown, and the first attempt commits${pinSentTwice ? ' (its pin sent twice, both runs joining)' : ''}`, async () => {
        // The reverse of the case above: a's commit is slow, the payment system's retry reaches b, joins a's epoch, and
        // b's call gets no answer. Were b to end the epoch, a would have to commit again in a new one, and a third
        // attempt that joined that one and failed the same way would turn a into 409 HOLD_LOST, its hold intact.
        const b = await world.start({
          SWEEP_INTERVAL_MS: '10000',
          RECONCILE_INTERVAL_MS: '0',
          REDIS_TIMEOUT_MS: pinSentTwice ? '300' : '2000',
        });
        try {
          // With pinSentTwice, b's pin answers after its timeout and is sent again: neither run opened the epoch.
          const pinSends = pinSentTwice ? pinAnsweredLate(b) : () => 1;
          await seedPool(api, pool, numbers(3, from));
          const r = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count: 3 });
          const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
          const path = `/v1/reservations/${r.body.id}/confirm`;
          const aGate = gate();
          const aResources = api.app.get(ResourceRepository);
          const allocate = aResources.allocate.bind(aResources);
          const aAllocate = vi
            .spyOn(aResources, 'allocate')
            .mockImplementation(async (allocation) => (await aGate.opened, allocate(allocation)));
          const bAllocate = vi
            .spyOn(b.app.get(ResourceRepository), 'allocate')
            .mockImplementation(() => lost(new Error('Query read timeout')));
          try {
            const first = api.post(path, { resourceIds: [x] });
            await sleep(200);
            const second = await b.post(path, { resourceIds: [x] });
            expect(pinSends()).toBe(pinSentTwice ? 2 : 1);
            expect(second.status).toBe(503);
            expect(second.body.error.details).toMatchObject({ dependency: 'postgres', outcome: 'unknown' });
            expect(second.body.error.message).toMatch(/another attempt of this confirm/);
            // Nothing ended epoch 1, and Redis still has it pinned for a.
            expect(await world.query(`SELECT epoch, decision FROM t_commit_decision WHERE reservation_id = $1`, [r.body.id])).toEqual([]);
            const stored = await b.app.get(HoldStore).read(pool, r.body.id);
            expect([stored?.state, stored?.epoch]).toEqual(['confirming', 1]);
            aGate.open();
            const answerA = await first;
            expect(answerA.status, JSON.stringify(answerA.body)).toBe(200);
            const decisions = await world.query(`SELECT epoch, decision FROM t_commit_decision WHERE reservation_id = $1`, [r.body.id]);
            expect(decisions).toEqual([{ epoch: 1, decision: 'commit' }]);
            bAllocate.mockRestore();
            // The payment system sends it once more: the same answer.
            const again = await b.post(path, { resourceIds: [x] });
            expect(again.status).toBe(200);
            expect(again.body).toEqual(answerA.body);
          } finally {
            aGate.open();
            aAllocate.mockRestore();
            bAllocate.mockRestore();
          }
          expect(await api.stats(pool)).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
        } finally {
          await b.close();
        }
      });
    }

    it('one that joined an epoch its opener failed and ended settles as the opener would: the plain 503, the reservation held again', async () => {
      const b = await world.start({ SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
      try {
        await seedPool(api, 'both-fail', numbers(3, '1394000'));
        const r = await api.post('/v1/pools/both-fail/reservations', { owner: 'buyer', count: 3 });
        const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
        const path = `/v1/reservations/${r.body.id}/confirm`;
        const aGate = gate();
        const aDone = gate();
        const aAllocate = vi.spyOn(api.app.get(ResourceRepository), 'allocate').mockImplementation(async () => {
          await aGate.opened;
          return lost(new Error('Query read timeout'));
        });
        const bAllocate = vi.spyOn(b.app.get(ResourceRepository), 'allocate').mockImplementation(async () => {
          await aDone.opened;
          return lost(new Error('Query read timeout'));
        });
        try {
          const first = api.post(path, { resourceIds: [x] });
          await sleep(200);
          const second = b.post(path, { resourceIds: [x] });
          await sleep(200);
          aGate.open();
          const answerA = await first;
          aDone.open();
          const answerB = await second;
          // a ended epoch 1 (its 503 is true); b's commit can no longer land either, so its 503 is true too.
          for (const answer of [answerA, answerB]) {
            expect(answer.status).toBe(503);
            expect(answer.body.error.message).toMatch(/nothing was changed/);
            expect(answer.body.error.details.outcome).toBeUndefined();
          }
          const stored = await b.app.get(HoldStore).read('both-fail', r.body.id);
          expect(stored?.state).toBe('held');
        } finally {
          aGate.open();
          aDone.open();
          aAllocate.mockRestore();
          bAllocate.mockRestore();
        }
        expect((await b.post(path, { resourceIds: [x] })).status).toBe(200);
      } finally {
        await b.close();
      }
    });

    it('one whose pin was sent twice (a Redis timeout) after its first run opened the epoch settles as the opener: the plain 503, Redis put back', async () => {
      const c = await world.start({ REDIS_TIMEOUT_MS: '300', SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
      try {
        await seedPool(c, 'pin-twice', numbers(3, '1396000'));
        const r = await c.post('/v1/pools/pin-twice/reservations', { owner: 'buyer', count: 3 });
        const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
        // The pin's first run opens epoch 1, but its answer comes after the timeout: HoldStore sends it again, and the
        // second run joins the epoch the first opened. Then the commit times out; Postgres ends the epoch.
        const pinSends = pinAnsweredLate(c);
        const timedOut = vi
          .spyOn(c.app.get(ResourceRepository), 'allocate')
          .mockImplementation(() => lost(new Error('Query read timeout')));
        let answer;
        try {
          answer = await c.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] });
        } finally {
          vi.restoreAllMocks();
          timedOut.mockRestore();
        }
        expect(pinSends()).toBe(2);
        // The second run knows the first opened the epoch (the attempt's token): it settles as the opener, and, as
        // one that opened the first epoch, puts Redis back as it was (no epoch).
        expect(answer.status).toBe(503);
        expect(answer.body.error.message).toMatch(/nothing was changed/);
        const stored = await c.app.get(HoldStore).read('pin-twice', r.body.id);
        expect([stored?.state, stored?.epoch]).toEqual(['held', 0]);
        expect((await c.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] })).status).toBe(200);
      } finally {
        await c.close();
      }
    });

    it('one whose pin was sent twice, another confirm of it pinning between the two runs, leaves Redis to that one', async () => {
      // c's pin opens epoch 1 and answers late; b's (the payment system's retry) joins epoch 1 before c's second run.
      // c's commit cannot reach Postgres, nor can c end the epoch: c must not put Redis back under b's commit.
      const c = await world.start({ REDIS_TIMEOUT_MS: '300', SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
      const b = await world.start({ SWEEP_INTERVAL_MS: '10000', RECONCILE_INTERVAL_MS: '0' });
      try {
        await seedPool(c, 'pin-twice-between', numbers(3, '1398000'));
        const r = await c.post('/v1/pools/pin-twice-between/reservations', { owner: 'buyer', count: 3 });
        const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
        const path = `/v1/reservations/${r.body.id}/confirm`;
        const pinSends = pinAnsweredLate(c);
        const refused = () => lost(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }));
        vi.spyOn(c.app.get(ResourceRepository), 'allocate').mockImplementation(refused);
        vi.spyOn(c.app.get(ResourceRepository), 'decideAbort').mockImplementation(refused);
        const cDone = gate();
        const bResources = b.app.get(ResourceRepository);
        const allocate = bResources.allocate.bind(bResources);
        vi.spyOn(bResources, 'allocate').mockImplementation(async (allocation) => (await cDone.opened, allocate(allocation)));
        let answerB;
        try {
          const first = c.post(path, { resourceIds: [x] });
          await sleep(100);
          const second = b.post(path, { resourceIds: [x] });
          const answerC = await first;
          expect(pinSends()).toBe(2);
          expect(answerC.status).toBe(503);
          // b's pin came after c's first run: Redis is still b's epoch 1, x still held.
          const stored = await b.app.get(HoldStore).read('pin-twice-between', r.body.id);
          expect([stored?.state, stored?.epoch]).toEqual(['confirming', 1]);
          expect(await b.app.get<Redis>(REDIS).get(poolKeys(world.prefix, 'pin-twice-between').hold(x))).toBe(r.body.id);
          cDone.open();
          answerB = await second;
        } finally {
          cDone.open();
          vi.restoreAllMocks();
        }
        expect(answerB.status, JSON.stringify(answerB.body)).toBe(200);
        expect(await c.stats('pin-twice-between')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
      } finally {
        await c.close();
        await b.close();
      }
    });

    it('a retry that would join an epoch whose attempt was undone opens a new one, and gives what it took back: the plain 503', async () => {
      await seedPool(api, 'retaken-join', numbers(3, '1395000'));
      const r = await api.post('/v1/pools/retaken-join/reservations', { owner: 'buyer', count: 3, ttlMs: 1000 });
      const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
      const pool = await api.app.get(PoolRepository).findByName('retaken-join');
      // Epoch 1 pinned and given up while the hold is due: held again, its holds ending with the hold.
      await stalledConfirm(api, 'retaken-join', r.body.id, x, 300);
      await sleep(400);
      expect(await api.app.get(CommitService).recoverStalled(pool!, r.body.id)).toBe('held');
      await sleep(Math.max(0, Date.parse(r.body.expiresAt) + api.config.HOLD_GRACE_MS + 100 - Date.now()));
      // Past the expiry, and Postgres refuses connections.
      const resources = api.app.get(ResourceRepository);
      const refused = () => lost(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }));
      const spies = [
        vi.spyOn(resources, 'allocate').mockImplementation(refused),
        vi.spyOn(resources, 'decideAbort').mockImplementation(refused),
      ];
      try {
        // The first confirm opens epoch 2, takes x back, cannot reach Postgres and gives x back (its epoch still open
        // in Redis). The caller's retry would join that epoch, but must take x back: nothing can land epoch 2, and
        // the retry opens epoch 3 (which it can settle on its own), takes x back, and gives it back in turn.
        const path = `/v1/reservations/${r.body.id}/confirm`;
        for (const attempt of [await api.post(path, { resourceIds: [x] }), await api.post(path, { resourceIds: [x] })]) {
          expect(attempt.status).toBe(503);
          expect(attempt.body.error.message).toMatch(/nothing was changed/);
        }
        expect((await api.app.get(HoldStore).read('retaken-join', r.body.id))?.epoch).toBe(3);
      } finally {
        for (const spy of spies) spy.mockRestore();
      }
      // Nothing holds x, and it is in the free index: not kept for an epoch nobody can land.
      const keys = poolKeys(world.prefix, 'retaken-join');
      const redis = api.app.get<Redis>(REDIS);
      expect(await redis.get(keys.hold(x))).toBeNull();
      expect(await redis.zscore(keys.free, freeMember(r.body.items[0].value, x))).toBe('0');
    });

    it('and Postgres cannot be asked either: 503 that says the outcome is not known, unless the commit never left', async () => {
      await seedPool(api, 'unknown', numbers(2, '1391000'));
      const r = await api.post('/v1/pools/unknown/reservations', { owner: 'buyer', count: 2 });
      const [x] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
      const resources = api.app.get(ResourceRepository);
      const decide = vi.spyOn(resources, 'decideAbort').mockImplementation(() => lost(new Error('Query read timeout')));
      const timedOut = vi.spyOn(resources, 'allocate').mockImplementation(() => lost(new Error('Query read timeout')));
      try {
        const answer = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] });
        expect(answer.status).toBe(503);
        expect(answer.body.error.details).toMatchObject({ dependency: 'postgres', outcome: 'unknown' });
        expect(answer.body.error.message).toMatch(/may have landed/);
        // A connection that could not be made: the commit never left, and the usual 503 is true.
        timedOut.mockImplementation(() => lost(Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' })));
        const refused = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] });
        expect(refused.status).toBe(503);
        expect(refused.body.error.message).toMatch(/nothing was changed/);
        expect(refused.body.error.details.outcome).toBeUndefined();
      } finally {
        decide.mockRestore();
        timedOut.mockRestore();
      }
      expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x] })).status).toBe(200);
    });
  });
});

// A confirm whose version check failed settles its reservation in Redis with what Postgres says now. That
// answer is fenced by its age (see abort.lua): one that reaches Redis too late is read again, and a
// confirm whose answer is refused every time changes nothing, answers 503, and leaves the sweeper to settle.
describe("settling a failed commit when Postgres' answer reaches Redis too late", () => {
  const world = new TestWorld('abort-retry');
  let api: TestInstance;
  let holds: HoldStore;
  let refusals = 0;

  beforeAll(async () => {
    // The window leaves the checks after a refused settlement time to run before a sweeper settles it.
    api = await world.start({ COMMIT_WINDOW_MS: '3000', RECONCILE_INTERVAL_MS: '0' });
    holds = api.app.get(HoldStore);
  });
  afterAll(() => world.cleanup());

  /** Makes the first `times` aborts of `pool` arrive as if this instance had stalled past READ_MAX_AGE_MS after its read. */
  function lateAborts(pool: string, times: number) {
    const abort = holds.abort.bind(holds);
    refusals = 0;
    return vi.spyOn(holds, 'abort').mockImplementation(async (name, rid, epoch, readAt, allocated, fresh) => {
      if (name !== pool || refusals >= times) return abort(name, rid, epoch, readAt, allocated, fresh);
      const how = await abort(name, rid, epoch, staleReadAt(readAt), allocated, fresh);
      if (how === 'tooOld') refusals++;
      return how;
    });
  }

  /** A reservation of both items of a new pool, whose first item moved on in Postgres behind its hold. */
  async function conflicted(pool: string) {
    await seedPool(api, pool, numbers(2));
    const r = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count: 2, ttlMs: 1000 });
    const [chosen, other] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    await world.query(`UPDATE t_resource SET version = version + 1 WHERE id = $1`, [chosen]);
    return { rid: r.body.id as string, chosen, other };
  }

  it('reads Postgres again and settles: the confirm answers 409 HOLD_LOST and both items are free', async () => {
    const { rid, chosen } = await conflicted('late-once');
    const late = lateAborts('late-once', 1);
    try {
      const confirm = await api.post(`/v1/reservations/${rid}/confirm`, { resourceIds: [chosen] });
      expect([confirm.status, confirm.body.error?.code, confirm.body.error?.details?.reason]).toEqual([
        409,
        'HOLD_LOST',
        'version_changed',
      ]);
      expect(refusals).toBe(1);
      expect(late).toHaveBeenCalledTimes(2);
    } finally {
      late.mockRestore();
    }
    // Settled by the second try: expired, both items back in the pool, the chosen one at its new version.
    expect((await holds.read('late-once', rid))?.state).toBe('expired');
    const again = await api.post('/v1/pools/late-once/reservations', { owner: 'next', count: 2 });
    expect(again.status).toBe(201);
    expect(again.body.items.find((i: { resourceId: string }) => i.resourceId === chosen).version).toBe(1);
  });

  it('refused three times: 503, nothing changed, and the sweeper settles it once the window is over', async () => {
    const { rid, chosen, other } = await conflicted('late-always');
    const late = lateAborts('late-always', 3);
    try {
      const confirm = await api.post(`/v1/reservations/${rid}/confirm`, { resourceIds: [chosen] });
      expect([confirm.status, confirm.body.error?.code]).toEqual([503, 'DEPENDENCY_UNAVAILABLE']);
      expect(refusals).toBe(3);
      // Redis is as the pin left it: the commit pinned, both holds the reservation's, nothing free.
      expect((await holds.read('late-always', rid))?.state).toBe('confirming');
      expect([await holds.holder('late-always', chosen), await holds.holder('late-always', other)]).toEqual([rid, rid]);
      expect((await api.post('/v1/pools/late-always/reservations', { owner: 'next', count: 1 })).body.error?.code).toBe('POOL_EXHAUSTED');
    } finally {
      late.mockRestore();
    }
    expect(await world.query(`SELECT count(*)::int AS n FROM t_resource WHERE id IN ($1, $2) AND state = 2`, [chosen, other])).toEqual([
      { n: 0 },
    ]);
    // Nothing lost: when the commit window ends, a sweeper asks Postgres and settles the reservation.
    const { value: back } = await eventually(async () => {
      const r = await api.post('/v1/pools/late-always/reservations', { owner: 'next', count: 2 });
      return r.status === 201 ? r : null;
    }, 8000);
    expect(back.body.items.map((i: { resourceId: string }) => i.resourceId).sort()).toEqual([chosen, other].sort());
    expect((await holds.read('late-always', rid))?.state).toBe('expired');
  });
});
