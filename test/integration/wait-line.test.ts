import type { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { HoldStore, ReserveRequest, WAIT_PLACE_MS, waitingLine } from '../../src/redis/hold-store.repository.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { WakeUps } from '../../src/redis/wake-ups.js';
import { makeReservationId, poolBase } from '../../src/redis/keys.js';
import { HttpAnswer, TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';

/**
 * The waiting line (reserve.lua, `line`): reserves that wait (waitMs) for the same filter take the free items in the
 * order they began to wait, first fit, across instances. DESIGN.md: fair FIFO waiting.
 */
describe('reserves that wait take their turn', () => {
  const world = new TestWorld('wait-line');
  let api: TestInstance;
  let other: TestInstance;
  let holds: HoldStore;
  let redis: Redis;

  beforeAll(async () => {
    api = await world.start();
    other = await world.start();
    holds = api.app.get(HoldStore);
    // Another instance's connection: what `api` sent is not ahead of these reads on the same connection by itself.
    redis = other.app.get<Redis>(REDIS);
  });
  afterAll(() => world.cleanup());

  const reserve = (pool: string, body: Record<string, unknown>, on = api) => on.post(`/v1/pools/${pool}/reservations`, body);
  /** One try of a reserve as the service sends it; `waits`: a try of a reserve with waitMs. */
  const request = (pool: string, owner: string, count: number, waits: boolean, filter: Partial<ReserveRequest> = {}): ReserveRequest => ({
    reservationId: makeReservationId(pool, randomUUID()),
    owner,
    count,
    ttlMs: 60_000,
    maxHoldsPerOwner: 0,
    kind: 'r',
    groupAffinity: false,
    waits,
    ...filter,
  });
  /** Holds each item of the pool in a reservation of its own; their ids. */
  const holdAll = async (pool: string, n: number) => {
    const ids: string[] = [];
    for (let i = 0; i < n; i++) {
      const held = await reserve(pool, { owner: 'holder', count: 1 });
      expect(held.status).toBe(201);
      ids.push(held.body.id);
    }
    return ids;
  };
  const release = async (id: string) => expect((await api.del(`/v1/reservations/${id}`)).status).toBe(200);
  /** A reserve of `count` for "gone" that waits up to 10 s, sent with `signal`: the error's name once it is aborted. */
  const waitingCaller = (on: TestInstance, pool: string, count: number, signal: AbortSignal) =>
    fetch(`${on.url}/v1/pools/${pool}/reservations`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ owner: 'gone', count, waitMs: 10_000 }),
      signal,
    }).catch((err: Error) => err.name);
  /** The members of the pool's line of unfiltered waiters. */
  const line = (pool: string) => redis.zrange(`${poolBase(world.prefix, pool)}wq:-`, 0, -1);

  it('the item freed goes to the waiter that began first, whichever tries first; then to the next', async () => {
    await seedPool(api, 'turns', numbers(1));
    const [blocker] = await holdAll('turns', 1);
    const first = request('turns', 'first', 1, true);
    const second = request('turns', 'second', 1, true);
    expect(await holds.reserve('turns', first)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 0 });
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false, inLine: 1, spare: 0 });
    // Turns numbered as they were given, not by the millisecond (two joins in one are in order too).
    expect(await redis.zrange(`${poolBase(world.prefix, 'turns')}wq:-`, 0, -1, 'WITHSCORES')).toEqual([
      `1 ${first.reservationId}`,
      '1',
      `1 ${second.reservationId}`,
      '2',
    ]);
    await release(blocker);
    // The item is free, but it is the first waiter's.
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1, inLine: 1, spare: 0 });
    expect((await holds.reserve('turns', first)).status).toBe('ok');
    // Served, the first has left the line: the second is next when the item comes back.
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 0 });
    expect(await line('turns')).toEqual([`1 ${second.reservationId}`]);
    await release(first.reservationId);
    expect((await holds.reserve('turns', second)).status).toBe('ok');
    expect(await line('turns')).toEqual([]);
  });

  it('over HTTP, on two instances: callers waiting for one item are served in the order they came', async () => {
    await seedPool(api, 'order', numbers(1));
    let [holder] = await holdAll('order', 1);
    const served: string[] = [];
    const waiters: Promise<HttpAnswer>[] = [];
    for (let i = 0; i < 5; i++) {
      const owner = `w${i}`;
      waiters.push(
        reserve('order', { owner, count: 1, waitMs: 15_000 }, i % 2 ? other : api).then((r) => {
          served.push(owner);
          return r;
        }),
      );
      await sleep(120);
    }
    for (let i = 0; i < 5; i++) {
      await release(holder);
      const got = await waiters[i];
      expect(got.status).toBe(201);
      holder = got.body.id;
    }
    expect(served).toEqual(['w0', 'w1', 'w2', 'w3', 'w4']);
  });

  it('not woken (wake-ups down), the first in line tries again at most every 75 ms; those behind it back off to 250-375 ms', async () => {
    await seedPool(api, 'quick', numbers(1));
    await holdAll('quick', 1);
    const real = holds.reserve.bind(holds);
    const tries: { owner: string; at: number }[] = [];
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      if (pool === 'quick') tries.push({ owner: req.owner, at: Date.now() });
      return real(pool, req);
    });
    const down = vi.spyOn(api.app.get(WakeUps), 'live').mockReturnValue(false);
    try {
      const started = Date.now();
      const head = reserve('quick', { owner: 'head', count: 1, waitMs: 2_000 });
      await sleep(100);
      const behind = reserve('quick', { owner: 'behind', count: 1, waitMs: 2_000 });
      expect((await head).status).toBe(409);
      expect((await behind).status).toBe(409);
      // In the second after the backoffs have grown: the head's pause stays short, the other's is at its longest.
      const during = (owner: string) => tries.filter((t) => t.owner === owner && t.at >= started + 600 && t.at < started + 1_600).length;
      expect(during('head')).toBeGreaterThanOrEqual(6);
      expect(during('head')).toBeGreaterThanOrEqual(2 * during('behind'));
      expect(during('behind')).toBeLessThanOrEqual(5);
    } finally {
      spy.mockRestore();
      down.mockRestore();
    }
  });

  it('not woken (wake-ups down), at most 64 waiters an instance try that often, however many are first in a line of their own', async () => {
    await seedPool(api, 'heads', numbers(1));
    await holdAll('heads', 1);
    const down = vi.spyOn(api.app.get(WakeUps), 'live').mockReturnValue(false);
    try {
      // 70 waiters, each the first and only one of its line (a value prefix of its own).
      const waiters = Array.from({ length: 70 }, (_, i) =>
        reserve('heads', { owner: `w${i}`, count: 1, waitMs: 1_500, filter: { valuePrefix: `1380000${String(i).padStart(3, '0')}` } }),
      );
      await sleep(700);
      expect((await api.get('/metrics')).body).toMatch(/^respool_waiting_reserves_first_in_line 64$/m);
      expect((await Promise.all(waiters)).every((r) => r.status === 409)).toBe(true);
      expect((await api.get('/metrics')).body).toMatch(/^respool_waiting_reserves_first_in_line 0$/m);
    } finally {
      down.mockRestore();
    }
  });

  it('woken when items come free, the first in line backs off like the others', async () => {
    await seedPool(api, 'backs', numbers(1));
    await holdAll('backs', 1);
    const real = holds.reserve.bind(holds);
    const tries: number[] = [];
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      if (pool === 'backs') tries.push(Date.now());
      return real(pool, req);
    });
    try {
      const started = Date.now();
      const head = reserve('backs', { owner: 'head', count: 1, waitMs: 1_600 });
      await sleep(300);
      expect(api.app.get(WakeUps).live('backs')).toBe(true);
      expect((await api.get('/metrics')).body).toMatch(/^respool_waiting_reserves_first_in_line 0$/m);
      expect((await head).status).toBe(409);
      // Backoff 25, 50, 100, 200, 250, 250... (to 1.5 times each): about 5 tries after the first 600 ms, not 13 or more.
      expect(tries.filter((at) => at >= started + 600).length).toBeLessThanOrEqual(7);
      // Its last waiter gone, the instance no longer listens to the pool.
      expect(api.app.get(WakeUps).live('backs')).toBe(false);
    } finally {
      spy.mockRestore();
    }
  });

  it('a waiter that needs more than the index lists stops before its pick; the next that fits the count drains stale entries', async () => {
    await seedPool(api, 'stale', numbers(2));
    const [blocker] = await holdAll('stale', 2);
    const free = `${poolBase(world.prefix, 'stale')}free`;
    const stale = '13899999999\u0000999999';
    await redis.zadd(free, 0, stale);
    await release(blocker);
    // One real entry and one stale: the waiter for 3 stops at the count, and leaves the stale entry where it is.
    const big = request('stale', 'big', 3, true);
    expect(await holds.reserve('stale', big)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 2 });
    expect(await redis.zscore(free, stale)).toBe('0');
    // The waiter for 2 behind it fits the count (nothing is kept for the first, which cannot use 2): its pick meets
    // the stale entry, fails and drains it, and gives the real item back.
    const two = request('stale', 'two', 2, true);
    expect(await holds.reserve('stale', two)).toEqual({ status: 'exhausted', limited: false, inLine: 1 });
    expect(await redis.zscore(free, stale)).toBeNull();
    expect(await redis.zcard(free)).toBe(1);
  });

  it('first fit: a later waiter gets the items an earlier one cannot use yet, and no more', async () => {
    await seedPool(api, 'fit', numbers(5));
    const held = await holdAll('fit', 5);
    const big = request('fit', 'big', 3, true);
    const small = request('fit', 'small', 1, true);
    const last = request('fit', 'last', 2, true);
    for (const r of [big, small, last]) expect((await holds.reserve('fit', r)).status).toBe('exhausted');
    await release(held[0]);
    // One free: too few for the waiter for 2 whatever is kept (no waitersAhead); the waiter for 3 cannot use it, so
    // the waiter for 1 behind it gets it.
    expect(await holds.reserve('fit', last)).toEqual({ status: 'exhausted', limited: false, inLine: 2, spare: 0 });
    expect((await holds.reserve('fit', small)).status).toBe('ok');
    for (const id of held.slice(1, 4)) await release(id);
    // Three free, kept for the waiter for 3: none for the waiter for 2 behind it.
    expect(await holds.reserve('fit', last)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1, inLine: 1, spare: 0 });
    expect((await holds.reserve('fit', big)).status).toBe('ok');
    await release(held[4]);
    await release(small.reservationId);
    expect((await holds.reserve('fit', last)).status).toBe('ok');
    expect(await api.stats('fit')).toEqual({ total: 5, free: 0, held: 5, allocated: 0 });
  });

  it("a reserve that does not wait takes what is free, waiters or not (a fair semaphore's tryAcquire)", async () => {
    await seedPool(api, 'barge', numbers(1));
    const [blocker] = await holdAll('barge', 1);
    const waiter = request('barge', 'waiter', 1, true);
    expect((await holds.reserve('barge', waiter)).status).toBe('exhausted');
    await release(blocker);
    expect((await reserve('barge', { owner: 'plain', count: 1 })).status).toBe(201);
    expect(await holds.reserve('barge', waiter)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 0 });
  });

  it("a waiter whose instance died is passed over once its place lapses: the item is the next one's within 2 s", async () => {
    await seedPool(api, 'dead', numbers(1));
    const [blocker] = await holdAll('dead', 1);
    const dead = request('dead', 'dead', 1, true);
    const live = request('dead', 'live', 1, true);
    expect((await holds.reserve('dead', dead)).status).toBe('exhausted');
    expect((await holds.reserve('dead', live)).status).toBe('exhausted');
    await release(blocker);
    const released = Date.now();
    // The live one tries as a waiter does, keeping its place (and the line) alive; the dead one never again.
    const tries: string[] = [];
    for (;;) {
      const result = await holds.reserve('dead', live);
      tries.push(result.status);
      if (result.status === 'ok' || Date.now() - released > 3_000) break;
      await sleep(200);
    }
    expect(tries.at(-1)).toBe('ok');
    expect(tries.length).toBeGreaterThan(1);
    expect(Date.now() - released).toBeLessThan(2_000);
    expect(Date.now() - released).toBeGreaterThanOrEqual(WAIT_PLACE_MS - 500);
  });

  it('a waiter that stalled past its place comes back at the end of the line', async () => {
    await seedPool(api, 'stalled', numbers(1));
    const [blocker] = await holdAll('stalled', 1);
    const stalled = request('stalled', 'stalled', 1, true);
    const next = request('stalled', 'next', 1, true);
    const joined = Date.now();
    expect((await holds.reserve('stalled', stalled)).status).toBe('exhausted');
    expect((await holds.reserve('stalled', next)).status).toBe('exhausted');
    // The one behind keeps its place, and finds the stalled one still live, so leaves it in the line.
    await sleep(WAIT_PLACE_MS * 0.6 - (Date.now() - joined));
    expect((await holds.reserve('stalled', next)).status).toBe('exhausted');
    // Back after its place lapsed, before the one behind has tried again: it joins behind it.
    await sleep(WAIT_PLACE_MS * 1.1 - (Date.now() - joined));
    expect(await holds.reserve('stalled', stalled)).toEqual({ status: 'exhausted', limited: false, inLine: 1, spare: 0 });
    await release(blocker);
    expect(await holds.reserve('stalled', stalled)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1, inLine: 1, spare: 0 });
    expect((await holds.reserve('stalled', next)).status).toBe('ok');
  });

  it('any number of lapsed places ahead are passed over in one try', async () => {
    await seedPool(api, 'crowd', numbers(1));
    const [blocker] = await holdAll('crowd', 1);
    const joined = Date.now();
    await Promise.all(Array.from({ length: 200 }, (_, i) => holds.reserve('crowd', request('crowd', `dead-${i}`, 1, true))));
    const live = request('crowd', 'live', 1, true);
    expect((await holds.reserve('crowd', live)).status).toBe('exhausted');
    // One try before the dead places lapse keeps the line alive; then the item comes back after they lapsed.
    await sleep(WAIT_PLACE_MS - 500 - (Date.now() - joined));
    expect((await holds.reserve('crowd', live)).status).toBe('exhausted');
    await sleep(WAIT_PLACE_MS + 100 - (Date.now() - joined));
    await release(blocker);
    expect((await holds.reserve('crowd', live)).status).toBe('ok');
  });

  it("a place half taken out of the line, or not a waiter's, holds nobody up and breaks nothing", async () => {
    await seedPool(api, 'half', numbers(1));
    const [blocker] = await holdAll('half', 1);
    const half = request('half', 'half', 1, true);
    const next = request('half', 'next', 1, true);
    expect((await holds.reserve('half', half)).status).toBe('exhausted');
    expect((await holds.reserve('half', next)).status).toBe('exhausted');
    const base = poolBase(world.prefix, 'half');
    await redis.zrem(`${base}wl:-`, `1 ${half.reservationId}`);
    // And a member that is not "<count> <rid>", with a place.
    await redis.zadd(`${base}wq:-`, 0, 'junk');
    await redis.zadd(`${base}wl:-`, Date.now() + 60_000, 'junk');
    await release(blocker);
    expect((await holds.reserve('half', next)).status).toBe('ok');
    expect(await redis.zrange(`${base}wq:-`, 0, -1)).toEqual([]);
    // The other half: a live place whose member is gone from the order. Its next try joins at the end.
    const blocker2 = next.reservationId;
    const again = request('half', 'again', 1, true);
    expect((await holds.reserve('half', again)).status).toBe('exhausted');
    await redis.zrem(`${base}wq:-`, `1 ${again.reservationId}`);
    expect((await holds.reserve('half', again)).status).toBe('exhausted');
    expect(await redis.zrange(`${base}wq:-`, 0, -1)).toEqual([`1 ${again.reservationId}`]);
    await release(blocker2);
    expect((await holds.reserve('half', again)).status).toBe('ok');
  });

  it('a waiter that gives up, is replayed or hangs up leaves the line before it answers', async () => {
    await seedPool(api, 'leave', numbers(2));
    const blockers = await holdAll('leave', 2);
    // Gives up; its leave is slowed, and still done before the answer.
    const real = holds.leaveLine.bind(holds);
    const slowed = vi.spyOn(holds, 'leaveLine').mockImplementation(async (pool, req) => {
      await sleep(300);
      await real(pool, req);
    });
    try {
      expect((await reserve('leave', { owner: 'gave-up', count: 1, waitMs: 300 })).status).toBe(409);
      expect(slowed).toHaveBeenCalledTimes(1);
    } finally {
      slowed.mockRestore();
    }
    expect(await line('leave')).toEqual([]);
    // Replayed: an earlier send with its key got the item while it waited.
    const keyed = (on: TestInstance) =>
      on.post('/v1/pools/leave/reservations', { owner: 'keyed', count: 1, waitMs: 3_000 }, { 'idempotency-key': 'k' });
    const sends = [keyed(api), keyed(other)];
    await sleep(300);
    expect((await line('leave')).length).toBe(2);
    await release(blockers[0]);
    expect((await Promise.all(sends)).map((r) => r.status).sort()).toEqual([200, 201]);
    expect(await line('leave')).toEqual([]);
    // Hangs up.
    const abort = new AbortController();
    const gone = waitingCaller(api, 'leave', 2, abort.signal);
    await sleep(200);
    expect((await line('leave')).length).toBe(1);
    abort.abort();
    expect(await gone).toBe('AbortError');
    await sleep(100);
    expect(await line('leave')).toEqual([]);
    await release(blockers[1]);
  });

  it("an instance closing while a hung-up waiter's try is under way closes Redis only after its leave", async () => {
    const closing = await world.start();
    await seedPool(closing, 'closing', numbers(1));
    await holdAll('closing', 1);
    const closingHolds = closing.app.get(HoldStore);
    const real = closingHolds.reserve.bind(closingHolds);
    let slow = false;
    let inTry!: () => void;
    const tryStarted = new Promise<void>((resolve) => (inTry = resolve));
    const spy = vi.spyOn(closingHolds, 'reserve').mockImplementation(async (pool, req) => {
      if (slow && req.waits) {
        inTry();
        await sleep(500);
      }
      return real(pool, req);
    });
    try {
      const abort = new AbortController();
      const gone = waitingCaller(closing, 'closing', 1, abort.signal);
      await sleep(200);
      expect((await line('closing')).length).toBe(1);
      slow = true;
      await tryStarted;
      abort.abort();
      expect(await gone).toBe('AbortError');
      await closing.close();
    } finally {
      spy.mockRestore();
    }
    expect(await line('closing')).toEqual([]);
  });

  it('past MAX_WAITING_RESERVES, one more tries once without a turn, then is 429: it leaves nothing in the line', async () => {
    const narrow = await world.start({ MAX_WAITING_RESERVES: '1' });
    await seedPool(narrow, 'narrow', numbers(2));
    await holdAll('narrow', 1);
    // One free: the waiter for 2 waits, and takes the instance's one place for waiters.
    const waiting = narrow.post('/v1/pools/narrow/reservations', { owner: 'b', count: 2, waitMs: 1_000 });
    await sleep(100);
    const [first] = await line('narrow');
    expect(first).toMatch(/^2 /);
    // Its try without a turn finds the free item.
    expect((await narrow.post('/v1/pools/narrow/reservations', { owner: 'c', count: 1, waitMs: 1_000 })).status).toBe(201);
    expect((await narrow.post('/v1/pools/narrow/reservations', { owner: 'd', count: 1, waitMs: 1_000 })).status).toBe(429);
    expect(await line('narrow')).toEqual([first]);
    expect((await waiting).status).toBe(409);
    expect(await line('narrow')).toEqual([]);
  });

  it('each filter has its own line, a value prefix alone included; filters with several conditions have none', async () => {
    const city = (c: string) => ({ value: numbers(1, c === 'bj' ? '1391000' : '1392000')[0], attributes: { city: c } });
    await seedPool(api, 'lines', [city('bj'), city('sh')]);
    const held = await holdAll('lines', 2);
    const bj = request('lines', 'bj-waiter', 1, true, { attributes: { city: 'bj' } });
    const sh = request('lines', 'sh-waiter', 1, true, { attributes: { city: 'sh' } });
    const byPrefix = request('lines', 'prefix-waiter', 1, true, { valuePrefix: '1391' });
    const prefixLater = request('lines', 'prefix-later', 1, true, { valuePrefix: '1391' });
    for (const r of [bj, sh, byPrefix, prefixLater]) expect((await holds.reserve('lines', r)).status).toBe('exhausted');
    for (const id of held) await release(id);
    // The bj waiter, first of all, holds up nobody in another line: not the sh waiter, not the prefix waiters, who
    // want the same bj number; in the prefix line, the first comes first.
    expect((await holds.reserve('lines', sh)).status).toBe('ok');
    expect(await holds.reserve('lines', prefixLater)).toEqual({
      status: 'exhausted',
      limited: false,
      waitersAhead: 1,
      inLine: 1,
      spare: 0,
    });
    expect((await holds.reserve('lines', byPrefix)).status).toBe('ok');
    expect(await holds.reserve('lines', bj)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 0 });
    expect(waitingLine({ kind: 'r', attributes: { city: 'bj' }, valuePrefix: '139' })).toBe('');
    expect(waitingLine({ kind: 'r', attributes: { city: 'bj', kind: 'vip' } })).toBe('');
  });

  it('gives each filter a line of its own and the unfiltered reserves one; task pulls take none', () => {
    expect(waitingLine({ kind: 'r' })).toBe('-');
    expect(waitingLine({ kind: 'r', attributes: {}, valuePrefix: '' })).toBe('-');
    const bj = waitingLine({ kind: 'r', attributes: { city: 'bj' } });
    expect(bj).toMatch(/^[A-Za-z0-9_-]{16}$/);
    expect(waitingLine({ kind: 'r', attributes: { city: 'sh' } })).not.toBe(bj);
    expect(waitingLine({ kind: 'r', valuePrefix: 'bj' })).not.toBe(waitingLine({ kind: 'r', attributes: { bj: '' } }));
    expect(waitingLine({ kind: 'l' })).toBe('');
  });
});
