import { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { HoldStore, WAIT_PLACE_MS } from '../../src/redis/hold-store.repository.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { makeReservationId, poolBase } from '../../src/redis/keys.js';
import { WakeUps, freedChannel, parseFreed } from '../../src/redis/wake-ups.js';
import { SweeperService } from '../../src/sweeper/sweeper.service.js';
import { REDIS_URL } from '../support/services.js';
import { GenerationRepository } from '../../src/database/generation.repository.js';
import { HttpAnswer, TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm } from '../support/harness.js';

/**
 * Waiters are woken when items come free (WakeUps, _lib.lua wake_waiters): the scripts that free items publish how
 * many while a reserve waits in the pool, and each instance wakes the first of each line of its waiters there.
 */
describe('waiters woken when items come free', () => {
  const world = new TestWorld('wake-ups');
  let api: TestInstance;
  let other: TestInstance;
  let listener: Redis;
  const heard: { channel: string; message: string }[] = [];

  beforeAll(async () => {
    api = await world.start();
    other = await world.start();
    listener = new Redis(REDIS_URL, { lazyConnect: true });
    await listener.connect();
    listener.on('message', (channel: string, message: string) => heard.push({ channel, message }));
  });
  afterAll(async () => {
    listener.disconnect();
    await world.cleanup();
  });

  const reserve = (pool: string, body: Record<string, unknown>, on = api) => on.post(`/v1/pools/${pool}/reservations`, body);
  const woken = async (on: TestInstance) =>
    Number(/^respool_waiting_reserves_woken_total (\d+)$/m.exec((await on.get('/metrics')).body)?.[1]);
  /** What was published on the pool's channel since `from` (an index into `heard`). */
  const published = (pool: string, from: number) =>
    heard
      .slice(from)
      .filter((h) => h.channel === freedChannel(world.prefix, pool))
      .map((h) => h.message);
  /** The request of a reserve that waits (tried by hand through HoldStore, as by an instance not started here). */
  const waiterRequest = (pool: string, count: number) => ({
    reservationId: makeReservationId(pool, randomUUID()),
    owner: 'waiter',
    count,
    ttlMs: 60_000,
    maxHoldsPerOwner: 0,
    kind: 'r' as const,
    groupAffinity: false,
    waits: true,
  });
  /** One try of a reserve that waits and finds too few items: what marks the pool as waited in. */
  const waiterTries = (pool: string) => api.app.get(HoldStore).reserve(pool, waiterRequest(pool, 1_000));

  const waitingOn = async (on: TestInstance) => Number(/^respool_waiting_reserves (\d+)$/m.exec((await on.get('/metrics')).body)?.[1]);
  /**
   * Starts reserves that wait (`bodies`) on `on` one after the other, each once the one before is waiting (so that they
   * wait in this order), and returns their answers once the instance listens to the pool.
   */
  const startWaiters = async (pool: string, bodies: Record<string, unknown>[], on = api) => {
    const base = await waitingOn(on);
    const answers: Promise<HttpAnswer>[] = [];
    for (const [i, body] of bodies.entries()) {
      answers.push(reserve(pool, body, on));
      await eventually(async () => (await waitingOn(on)) >= base + i + 1, 5_000, 5);
    }
    await eventually(async () => on.app.get(WakeUps).live(pool), 5_000, 5);
    return answers;
  };
  /** The values of the items a reservation answer lists, sorted. */
  const valuesOf = (reservation: { items: { value: string }[] }) => reservation.items.map((i) => i.value).sort();
  /** The values a message lists, sorted; or the count it gives. */
  const freedValues = (message: string) => {
    const freed = parseFreed(message);
    return freed?.items ? freed.items.map((i) => i.v).sort() : freed?.count;
  };

  it('the scripts that free items publish which while a reserve waits in the pool, and nothing while none does', async () => {
    await seedPool(api, 'pub', [...numbers(5), { value: '13700000000', attributes: { color: 'red' } }]);
    // This test sweeps by hand, after marking the pool as waited in: no instance's own timer may sweep first.
    for (const instance of [api, other]) await instance.app.get(SweeperService).onModuleDestroy();
    const ww = `${poolBase(world.prefix, 'pub')}ww`;
    await listener.subscribe(freedChannel(world.prefix, 'pub'));
    const redis = api.app.get<Redis>(REDIS);

    // Nobody waits: a release publishes nothing, and a reserve that does not wait marks nothing.
    let from = heard.length;
    const quiet = await reserve('pub', { owner: 'o', count: 3 });
    expect((await reserve('pub', { owner: 'o', count: 100 })).status).toBe(409);
    expect(await redis.exists(ww)).toBe(0);
    expect((await api.del(`/v1/reservations/${quiet.body.id}`)).status).toBe(200);

    // A waiter's try marks the pool for as long as its place lasts.
    expect((await waiterTries('pub')).status).toBe('exhausted');
    const pttl = await redis.pttl(ww);
    expect(pttl).toBeGreaterThan(0);
    expect(pttl).toBeLessThanOrEqual(WAIT_PLACE_MS);
    await sleep(100);
    expect(published('pub', from)).toEqual([]);
    // The steps below go through Postgres, which may outlast a place on a loaded machine: the mark is kept by hand.
    await redis.set(ww, '1', 'PX', 60_000);

    // Releases: the items came free, with their attributes.
    from = heard.length;
    const released = await reserve('pub', { owner: 'o', count: 1, filter: { valuePrefix: '137' } }).then(async (one) => [
      one.body,
      (await reserve('pub', { owner: 'o', count: 2 })).body,
    ]);
    for (const r of released) expect((await api.del(`/v1/reservations/${r.id}`)).status).toBe(200);
    await eventually(async () => published('pub', from).length === 2, 2_000, 10);
    const [withAttributes, plain] = published('pub', from);
    expect(JSON.parse(withAttributes)).toEqual([{ v: '13700000000', a: { color: 'red' } }]);
    // Items without attributes are listed by value alone (in the reservation's order).
    expect(freedValues(plain)).toEqual(valuesOf(released[1]));
    expect(JSON.parse(plain).every((i: object) => Object.keys(i).join() === 'v')).toBe(true);

    // Confirm of 1 of 3: the 2 others came free (finish.lua).
    from = heard.length;
    const confirmed = (await reserve('pub', { owner: 'o', count: 3 })).body;
    const chosen = confirmed.items[0];
    expect((await api.post(`/v1/reservations/${confirmed.id}/confirm`, { resourceIds: [chosen.resourceId] })).status).toBe(200);
    await eventually(async () => published('pub', from).length > 0, 2_000, 10);
    expect(published('pub', from).map(freedValues)).toEqual([valuesOf(confirmed).filter((v) => v !== chosen.value)]);

    // Expiry: the sweep frees the 2 held items.
    from = heard.length;
    const expiring = (await reserve('pub', { owner: 'o', count: 2, ttlMs: 1000 })).body;
    await sleep(1000 + api.config.HOLD_GRACE_MS + 50);
    await api.app.get(SweeperService).tick();
    await eventually(async () => published('pub', from).length > 0, 2_000, 10);
    expect(published('pub', from).map(freedValues)).toEqual([valuesOf(expiring)]);

    // Imports: the new items came free (add_free.lua); more than 32 at once, only how many.
    from = heard.length;
    expect((await api.post('/v1/pools/pub/resources', { items: [{ value: '13900000001' }, { value: '13900000002' }] })).status).toBe(201);
    expect((await api.post('/v1/pools/pub/resources', { items: numbers(40, '1360000').map((value) => ({ value })) })).status).toBe(201);
    await eventually(async () => published('pub', from).length === 2, 2_000, 10);
    expect(published('pub', from).map(freedValues)).toEqual([['13900000001', '13900000002'], 40]);

    // Items free already, put in the index again (a reconcile re-adds every free row): nothing came free, nothing is
    // said; with one that was not free among them, only that one.
    from = heard.length;
    const rows = await world.query<{ id: string; value: string; version: number }>(
      `SELECT id::text AS id, value, version FROM t_resource WHERE value LIKE '1360000%' ORDER BY value LIMIT 3`,
    );
    const holds = api.app.get(HoldStore);
    const generation = await api.app.get(GenerationRepository).current();
    const cached = rows.map((row) => ({ id: row.id, v: row.value, n: row.version }));
    expect(await holds.addFree('pub', generation, await holds.clock(), cached)).toBe(0);
    await redis.zrem(`${poolBase(world.prefix, 'pub')}free`, `${cached[2].v}\u0000${cached[2].id}`);
    expect(await holds.addFree('pub', generation, await holds.clock(), cached)).toBe(1);
    await eventually(async () => published('pub', from).length > 0, 2_000, 10);
    await sleep(100);
    expect(published('pub', from).map(freedValues)).toEqual([[cached[2].v]]);
  });

  it('a commit given up (abort) and an un-pin of what a pin took back publish the items they free', async () => {
    // The sweepers are stopped (above): this test sweeps and settles by hand.
    const redis = api.app.get<Redis>(REDIS);
    const holds = api.app.get(HoldStore);
    const sweeper = api.app.get(SweeperService);
    for (const pool of ['given-up', 'taken-back']) {
      await seedPool(api, pool, numbers(3, pool === 'given-up' ? '1350000' : '1340000'));
      await listener.subscribe(freedChannel(world.prefix, pool));
      await redis.set(`${poolBase(world.prefix, pool)}ww`, '1', 'PX', 60_000);
    }

    // A confirm pinned one item and never reached Postgres (its instance died): once its window and the hold have
    // ended, the sweep frees the two items it did not choose, and the sweeper gives the commit up and frees the third.
    let from = heard.length;
    const stalled = (await reserve('given-up', { owner: 'o', count: 3, ttlMs: 1000 })).body;
    const chosen = stalled.items[0];
    await stalledConfirm(api, 'given-up', stalled.id, chosen.resourceId, 1000);
    await sleep(1000 + api.config.HOLD_GRACE_MS + 100);
    await eventually(
      async () => {
        await sweeper.tick();
        await sweeper.upkeep();
        return published('given-up', from).some((m) => JSON.stringify(freedValues(m)).includes(chosen.value));
      },
      5_000,
      100,
    );
    expect(
      published('given-up', from)
        .flatMap((m) => freedValues(m) as string[])
        .sort(),
    ).toEqual(valuesOf(stalled));

    // A confirm after the hold ran out takes the item back (pin); its commit cannot land (Postgres unreachable, say):
    // the un-pin puts the item back, and says so.
    from = heard.length;
    const late = (await reserve('taken-back', { owner: 'o', count: 1, ttlMs: 1000 })).body;
    await sleep(1000 + api.config.HOLD_GRACE_MS + 100);
    const pinned = await holds.pin('taken-back', late.id, [late.items[0].resourceId], 5_000);
    expect(pinned.status).toBe('pinned');
    if (pinned.status !== 'pinned') return;
    expect(pinned.retaken).toEqual([late.items[0].resourceId]);
    await sleep(100);
    expect(published('taken-back', from)).toEqual([]);
    await holds.unpin('taken-back', pinned, true);
    await eventually(async () => published('taken-back', from).length > 0, 2_000, 10);
    expect(published('taken-back', from).map(freedValues)).toEqual([[late.items[0].value]]);
  });

  it('a waiter on another instance is woken when an item comes free: served at once, not at its next try', async () => {
    await seedPool(api, 'wake', numbers(1));
    const holder = await reserve('wake', { owner: 'holder', count: 1 });
    const holds = other.app.get(HoldStore);
    const real = holds.reserve.bind(holds);
    const tries: { start: number; end: number }[] = [];
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      const start = Date.now();
      const result = await real(pool, req);
      if (pool === 'wake') tries.push({ start, end: Date.now() });
      return result;
    });
    try {
      const before = await woken(other);
      const waiter = reserve('wake', { owner: 'waiter', count: 1, waitMs: 10_000 }, other);
      // Its backoff has reached 250-375 ms after about 800 ms: release the item just after one of its tries.
      await sleep(900);
      await eventually(async () => other.app.get(WakeUps).live('wake'), 5_000, 5);
      const seen = tries.length;
      await eventually(async () => tries.length > seen, 2_000, 1);
      expect((await api.del(`/v1/reservations/${holder.body.id}`)).status).toBe(200);
      const released = Date.now();
      const got = await waiter;
      expect(got.status).toBe(201);
      // The try that served it began as the release ended, not when its pause (at least 250 ms from the try before,
      // which ended just before the release began) would have.
      const serving = tries[tries.length - 1];
      expect(serving.start - released).toBeLessThan(100);
      expect(await woken(other)).toBe(before + 1);
    } finally {
      spy.mockRestore();
    }
  });

  it('items coming free wake as many waiters of each line on an instance as came free, not every waiter', async () => {
    await seedPool(api, 'herd', numbers(1));
    const holder = await reserve('herd', { owner: 'holder', count: 1 });
    const before = await woken(api);
    // Four waiters in the unfiltered line, two in the line of a value prefix: one item matches both lines.
    const waiters = await startWaiters('herd', [
      ...Array.from({ length: 4 }, (_, i) => ({ owner: `plain${i}`, count: 1, waitMs: 2_000 })),
      ...Array.from({ length: 2 }, (_, i) => ({ owner: `prefixed${i}`, count: 1, waitMs: 2_000, filter: { valuePrefix: '138' } })),
    ]);
    expect((await api.del(`/v1/reservations/${holder.body.id}`)).status).toBe(200);
    const answers = await Promise.all(waiters);
    // One came free: the first waiter of each line was woken, 2 in all, not 6, and one of those two got it.
    expect(answers.filter((a) => a.status === 201)).toHaveLength(1);
    expect([answers[0].status, answers[4].status].sort()).toEqual([201, 409]);
    expect((await woken(api)) - before).toBe(2);
  });

  it('a waiter whose filter has several conditions (each try a pass over sets in Redis) backs off to 2 s while woken by frees, and a matching free still serves it at once', async () => {
    await seedPool(api, 'lineless', [
      { value: '13900000001', attributes: { city: 'bj', carrier: 'x' } },
      { value: '13900000002', attributes: { city: 'sh', carrier: 'y' } },
    ]);
    const holder = await reserve('lineless', { owner: 'holder', count: 2 });
    expect(holder.status).toBe(201);
    const holds = api.app.get(HoldStore);
    const reserveOnce = holds.reserve.bind(holds);
    const triedAt: number[] = [];
    const tries = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, request) => {
      if (pool === 'lineless') triedAt.push(Date.now());
      return reserveOnce(pool, request);
    });
    onTestFinished(() => tries.mockRestore());
    const filter = { attributes: { city: 'bj', carrier: 'x' } };
    const [waiter] = await startWaiters('lineless', [{ owner: 'patient', count: 1, waitMs: 15_000, filter }]);
    // 25, 50, 100 ... ms, then 2 s (to 3 s with the jitter): at most 11 tries in 9 s; 30 or more at the 250 ms of a
    // waiter with a line.
    await sleep(9_000);
    expect(triedAt.length).toBeGreaterThanOrEqual(3);
    expect(triedAt.length).toBeLessThanOrEqual(11);
    // Freed more than a second after its last try (the place of a waiter with a line lasts 1 s): the pool is still
    // marked as waited in, so the free is published and wakes it.
    await eventually(async () => Date.now() - triedAt.at(-1)! >= 1_100, 5_000, 10);
    const released = Date.now();
    expect((await api.del(`/v1/reservations/${holder.body.id}`)).status).toBe(200);
    const served = await waiter;
    expect(served.status).toBe(201);
    expect(served.body.items[0].value).toBe('13900000001');
    // Woken, not found at its next try up to 3 s later.
    expect(Date.now() - released).toBeLessThan(1_000);
  });

  it('first fit: a waiter behind one that wants more than came free is woken too, and gets it', async () => {
    await seedPool(api, 'fit', numbers(1));
    const holder = (await reserve('fit', { owner: 'holder', count: 1 })).body;
    const before = await woken(api);
    const [big, small, third] = await startWaiters('fit', [
      { owner: 'big', count: 2, waitMs: 2_000 },
      { owner: 'small', count: 1, waitMs: 2_000 },
      { owner: 'third', count: 1, waitMs: 2_000 },
    ]);
    expect((await api.del(`/v1/reservations/${holder.id}`)).status).toBe(200);
    // The first (it may have been short of one only) and the one the item serves; not the one behind that.
    expect((await small).status).toBe(201);
    expect((await woken(api)) - before).toBe(2);
    expect((await big).status).toBe(409);
    expect((await third).status).toBe(409);
  });

  it('a waiter refused for too few reports what the waiters ahead of it leave of the matching free items', async () => {
    await seedPool(api, 'spare', []);
    const holds = api.app.get(HoldStore);
    const waiterFor = (count: number) => ({ ...waiterRequest('spare', count), owner: `w${count}` });
    const [two, three] = [waiterFor(2), waiterFor(3)];
    expect(await holds.reserve('spare', two)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 0 });
    expect(await holds.reserve('spare', three)).toEqual({ status: 'exhausted', limited: false, inLine: 1, spare: 0 });
    expect((await api.post('/v1/pools/spare/resources', { items: numbers(3).map((value) => ({ value })) })).status).toBe(201);
    // 3 free: 2 kept for the waiter ahead, 1 left.
    expect(await holds.reserve('spare', three)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1, inLine: 1, spare: 1 });
    expect((await holds.reserve('spare', two)).status).toBe('ok');
    expect(await holds.reserve('spare', three)).toEqual({ status: 'exhausted', limited: false, inLine: 0, spare: 1 });
  });

  it('a waiter behind a larger one, served by what came free with what was free before, is woken by its try', async () => {
    // 2 free, 1 held: the release frees 1, which alone serves neither waiter; the first is woken whatever its count.
    await seedPool(api, 'behind', numbers(3));
    const holder = (await reserve('behind', { owner: 'holder', count: 1 })).body;
    const holds = api.app.get(HoldStore);
    const real = holds.reserve.bind(holds);
    let smallTries = 0;
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      const result = await real(pool, req);
      if (pool === 'behind' && req.count === 3) smallTries++;
      return result;
    });
    try {
      const before = await woken(api);
      const [big, small] = await startWaiters('behind', [
        { owner: 'big', count: 5, waitMs: 3_000 },
        { owner: 'small', count: 3, waitMs: 3_000 },
      ]);
      // Once the small one's backoff is long, just after one of its tries: it would not try again for 250 ms or more.
      await sleep(900);
      const seen = smallTries;
      await eventually(async () => smallTries > seen, 2_000, 1);
      expect((await api.del(`/v1/reservations/${holder.id}`)).status).toBe(200);
      expect((await small).status).toBe(201);
      // The first by the message; the one behind it by the first's try, which found 3 free that it left.
      expect((await woken(api)) - before).toBeGreaterThanOrEqual(2);
      expect((await big).status).toBe(409);
    } finally {
      spy.mockRestore();
    }
  });

  for (const when of ['pausing', 'trying'] as const) {
    it(`a waiter that leaves its line with items kept for it wakes the waiters behind it they were kept from (${when === 'pausing' ? 'in their pause' : 'the refusal of their try still on its way'})`, async () => {
      const pool = `leave-${when}`;
      await seedPool(api, pool, numbers(2));
      await listener.subscribe(freedChannel(world.prefix, pool));
      const redis = api.app.get<Redis>(REDIS);
      const holds = api.app.get(HoldStore);
      const holder = (await reserve(pool, { owner: 'holder', count: 2 })).body;
      // A waiter whose instance is not one of these (its tries are made by hand): first in line, for 2.
      const ahead = waiterRequest(pool, 2);
      expect((await holds.reserve(pool, ahead)).status).toBe('exhausted');
      const [behind] = await startWaiters(pool, [{ owner: 'behind', count: 2, waitMs: 5_000 }], other);
      // Its place lasts as long as the line does (the waiter behind keeps the line's keys).
      await redis.zadd(`${poolBase(world.prefix, pool)}wl:-`, Date.now() + 60_000, `2 ${ahead.reservationId}`);
      const otherHolds = other.app.get(HoldStore);
      const real = otherHolds.reserve.bind(otherHolds);
      let keptFrom = false;
      let from = heard.length;
      const spy = vi.spyOn(otherHolds, 'reserve').mockImplementation(async (p, req) => {
        const result = await real(p, req);
        if (p === pool && result.status === 'exhausted' && result.waitersAhead === 1 && !keptFrom) {
          keptFrom = true;
          if (when === 'trying') {
            // The one ahead leaves after this try ran, and its message arrives before this try's answer.
            from = heard.length;
            await holds.leaveLine(pool, ahead);
            await eventually(async () => published(pool, from).length > 0, 2_000, 5);
            await sleep(50);
          }
        }
        return result;
      });
      try {
        const before = await woken(other);
        // Once its backoff is long (its next try 250 ms or more after the one the free wakes), 2 come free: the waiter
        // behind is woken, and finds them kept for the one ahead.
        await sleep(900);
        expect((await api.del(`/v1/reservations/${holder.id}`)).status).toBe(200);
        await eventually(async () => keptFrom, 2_000, 5);
        if (when === 'pausing') {
          from = heard.length;
          await holds.leaveLine(pool, ahead);
        }
        expect((await behind).status).toBe(201);
        expect(published(pool, from)).toEqual(['left - 2']);
        // Woken by the free, then by the leave.
        expect((await woken(other)) - before).toBe(2);
      } finally {
        spy.mockRestore();
      }
    });
  }

  it('a waiter leaving its line says nothing when nobody is behind it, or its place was gone', async () => {
    await seedPool(api, 'leave-quiet', []);
    await listener.subscribe(freedChannel(world.prefix, 'leave-quiet'));
    const holds = api.app.get(HoldStore);
    const [first, last] = [waiterRequest('leave-quiet', 5), waiterRequest('leave-quiet', 5)];
    for (const w of [first, last]) expect((await holds.reserve('leave-quiet', w)).status).toBe('exhausted');
    const from = heard.length;
    // The last (a waiter ahead stays), then the first alone, then the first again (no place).
    await holds.leaveLine('leave-quiet', last);
    await holds.leaveLine('leave-quiet', first);
    await holds.leaveLine('leave-quiet', first);
    // A leave that has someone behind it is heard (and so would these be, by now).
    const [one, two] = [waiterRequest('leave-quiet', 3), waiterRequest('leave-quiet', 5)];
    for (const w of [one, two]) expect((await holds.reserve('leave-quiet', w)).status).toBe('exhausted');
    await holds.leaveLine('leave-quiet', one);
    await eventually(async () => published('leave-quiet', from).includes('left - 3'), 2_000, 5);
    expect(published('leave-quiet', from)).toEqual(['left - 3']);
  });

  it('only the waiters whose filter an item that came free matches are woken', async () => {
    await seedPool(api, 'match', [
      { value: '13800000000', attributes: { color: 'red' } },
      { value: '13900000000', attributes: { color: 'blue' } },
    ]);
    const held = (await reserve('match', { owner: 'holder', count: 2 })).body;
    const before = await woken(api);
    const filters: Record<string, Record<string, unknown> | undefined> = {
      prefix139: { valuePrefix: '139' },
      blue: { attributes: { color: 'blue' } },
      red: { attributes: { color: 'red' } },
      any: undefined,
      both: { valuePrefix: '138', attributes: { color: 'blue' } },
    };
    const answers = await startWaiters(
      'match',
      Object.entries(filters).map(([owner, filter]) => ({ owner, count: 1, waitMs: 2_000, filter })),
    );
    const waiters = Object.fromEntries(Object.keys(filters).map((owner, i) => [owner, answers[i]]));
    // Only the red 138… item comes free (a release of one item of two is a confirm of the other).
    const blue = held.items.find((i: { value: string }) => i.value !== '13800000000');
    expect((await api.post(`/v1/reservations/${held.id}/confirm`, { resourceIds: [blue.resourceId] })).status).toBe(200);
    const statuses = Object.fromEntries(await Promise.all(Object.entries(waiters).map(async ([k, p]) => [k, (await p).status])));
    expect([statuses.red, statuses.any].sort()).toEqual([201, 409]);
    expect(statuses).toMatchObject({ prefix139: 409, blue: 409, both: 409 });
    // The red and the unfiltered waiters; not the three whose filter it does not match.
    expect((await woken(api)) - before).toBe(2);
  });

  it('one message wakes at most 64 waiters, however many filters it matches', async () => {
    const attributes = Object.fromEntries(Array.from({ length: 10 }, (_, k) => [`a${k}`, '1']));
    await seedPool(api, 'many', [{ value: '13800000000', attributes }]);
    const held = (await reserve('many', { owner: 'holder', count: 1 })).body;
    const before = await woken(api);
    // 70 waiters, each with a filter of its own (a prefix and an attribute) that the one item matches.
    const prefixes = ['1', '13', '138', '1380', '13800', '138000', '1380000'];
    const waiters = prefixes.flatMap((valuePrefix) =>
      Array.from({ length: 10 }, (_, k) =>
        reserve('many', {
          owner: `w${valuePrefix}-${k}`,
          count: 1,
          waitMs: 3_000,
          filter: { valuePrefix, attributes: { [`a${k}`]: '1' } },
        }),
      ),
    );
    await eventually(async () => (await waitingOn(api)) === 70 && api.app.get(WakeUps).live('many'), 5_000, 10);
    expect((await api.del(`/v1/reservations/${held.id}`)).status).toBe(200);
    const answers = await Promise.all(waiters);
    expect(answers.filter((a) => a.status === 201)).toHaveLength(1);
    expect((await woken(api)) - before).toBe(64);
  });

  it('a waiter woken again before its next try is counted once: the second wake-up changes nothing', async () => {
    await seedPool(api, 'twice', numbers(1));
    await reserve('twice', { owner: 'holder', count: 1 });
    const holds = api.app.get(HoldStore);
    const real = holds.reserve.bind(holds);
    const publisher = api.app.get<Redis>(REDIS);
    let sent = false;
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      const result = await real(pool, req);
      if (pool === 'twice' && !sent && api.app.get(WakeUps).live('twice')) {
        // Two messages arrive during one try (items that are not in the pool: the try they cause finds nothing).
        sent = true;
        const from = heard.length;
        await listener.subscribe(freedChannel(world.prefix, 'twice'));
        for (const v of ['13899999998', '13899999999'])
          await publisher.publish(freedChannel(world.prefix, 'twice'), JSON.stringify([{ v }]));
        await eventually(async () => published('twice', from).length === 2, 2_000, 5);
        await sleep(50);
      }
      return result;
    });
    try {
      const before = await woken(api);
      expect((await reserve('twice', { owner: 'waiter', count: 1, waitMs: 1_500 })).status).toBe(409);
      expect(sent).toBe(true);
      expect((await woken(api)) - before).toBe(1);
    } finally {
      spy.mockRestore();
    }
  });

  it('a waiter woken during a try tries again as soon as that try ends', async () => {
    await seedPool(api, 'midtry', numbers(1));
    const holder = (await reserve('midtry', { owner: 'holder', count: 1 })).body;
    const holds = api.app.get(HoldStore);
    const real = holds.reserve.bind(holds);
    const tries: { start: number; end: number }[] = [];
    let gate: Promise<void> | null = null;
    let freeItem: (() => Promise<void>) | null = null;
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      const start = Date.now();
      const result = await real(pool, req);
      // Once its backoff is long: the item comes free after this try's script ran, before the try ends.
      if (pool === 'midtry' && freeItem) {
        const free = freeItem;
        freeItem = null;
        gate = free();
        await gate;
      }
      if (pool === 'midtry') tries.push({ start, end: Date.now() });
      return result;
    });
    try {
      const before = await woken(api);
      const waiter = reserve('midtry', { owner: 'waiter', count: 1, waitMs: 10_000 });
      await sleep(900);
      freeItem = async () => {
        expect((await other.del(`/v1/reservations/${holder.id}`)).status).toBe(200);
        // The message has reached this instance, and found the waiter in its try.
        await eventually(async () => (await woken(api)) > before, 2_000, 5);
      };
      expect((await waiter).status).toBe(201);
      expect(gate).not.toBeNull();
      const [during, serving] = tries.slice(-2);
      expect(serving.start - during.end).toBeLessThan(100);
    } finally {
      spy.mockRestore();
    }
  });

  it('WAIT_WAKE_UPS=false: waiters are never woken, and the first in line tries again every 50-75 ms', async () => {
    const off = await world.start({ WAIT_WAKE_UPS: 'false' });
    await seedPool(api, 'off', numbers(1));
    const holder = (await reserve('off', { owner: 'holder', count: 1 })).body;
    const waiter = reserve('off', { owner: 'waiter', count: 1, waitMs: 10_000 }, off);
    await eventually(async () => (await waitingOn(off)) === 1, 5_000, 5);
    await sleep(100);
    expect(off.app.get(WakeUps).live('off')).toBe(false);
    expect((await off.get('/metrics')).body).toMatch(/^respool_waiting_reserves_first_in_line 1$/m);
    // It does not mark the pool as waited in: the scripts that free items in it say nothing.
    expect(await api.app.get<Redis>(REDIS).exists(`${poolBase(world.prefix, 'off')}ww`)).toBe(0);
    expect((await api.del(`/v1/reservations/${holder.id}`)).status).toBe(200);
    expect((await waiter).status).toBe(201);
    expect((off.app.get(WakeUps) as unknown as { connection?: Redis }).connection).toBeUndefined();
  });

  it('after its connection drops, an instance subscribes again and wakes its waiters as before', async () => {
    await seedPool(api, 'again', numbers(1));
    const holder = await reserve('again', { owner: 'holder', count: 1 });
    const wakeUps = api.app.get(WakeUps);
    const waiter = reserve('again', { owner: 'waiter', count: 1, waitMs: 10_000 });
    await eventually(async () => wakeUps.live('again'), 2_000, 10);
    const before = await woken(api);
    (wakeUps as unknown as { connection: Redis }).connection.stream.destroy();
    await eventually(async () => !wakeUps.live('again'), 1_000, 1);
    await eventually(async () => wakeUps.live('again'), 5_000, 10);
    expect((await other.del(`/v1/reservations/${holder.body.id}`)).status).toBe(200);
    expect((await waiter).status).toBe(201);
    expect(await woken(api)).toBe(before + 1);
  });
});

describe('waiters when Redis refuses the wake-up channel (an ACL user without it)', () => {
  const user = `rptest-nochannels-${process.pid}`;
  const url = new URL(REDIS_URL);
  url.username = user;
  url.password = 'secret';
  const world = new TestWorld('wake-ups-acl', { REDIS_URL: url.toString() });
  let admin: Redis;
  let api: TestInstance;

  beforeAll(async () => {
    admin = new Redis(REDIS_URL);
    // Every key and command, no channel: PUBLISH and SUBSCRIBE are refused (NOPERM).
    await admin.call('ACL', 'SETUSER', user, 'reset', 'on', '>secret', '~*', '+@all', 'resetchannels');
    api = await world.start();
  });
  afterAll(async () => {
    await world.cleanup();
    await admin.call('ACL', 'DELUSER', user);
    admin.disconnect();
  });

  it('a release with a reserve waiting still completes, and the waiter gets the item by trying again', async () => {
    await seedPool(api, 'acl', numbers(1));
    const holder = (await api.post('/v1/pools/acl/reservations', { owner: 'holder', count: 1 })).body;
    const waiter = api.post('/v1/pools/acl/reservations', { owner: 'waiter', count: 1, waitMs: 5_000 });
    await sleep(300);
    expect(api.app.get(WakeUps).live('acl')).toBe(false);
    // The pool is marked as waited in: the release's PUBLISH is sent, and refused.
    expect(await admin.exists(`${poolBase(world.prefix, 'acl')}ww`)).toBe(1);
    const released = await api.del(`/v1/reservations/${holder.id}`);
    expect(released.status).toBe(200);
    expect(released.body.state).toBe('released');
    const got = await waiter;
    expect(got.status).toBe(201);
    expect(got.body.items.map((i: { value: string }) => i.value)).toEqual(numbers(1));
  });
});
