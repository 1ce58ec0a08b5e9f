import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { HoldStore, ReserveRequest, WAIT_PLACE_MS, waitingLine } from '../../src/redis/hold-store.repository.js';
import { makeReservationId } from '../../src/redis/keys.js';
import { TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';

/**
 * The waiting line (reserve.lua, `line`): reserves that wait (waitMs) for the same filter take the free items in the
 * order they began to wait, first fit; one that does not wait comes after them. DESIGN.md: fair FIFO waiting.
 */
describe('reserves that wait take their turn', () => {
  const world = new TestWorld('wait-line');
  let api: TestInstance;
  let holds: HoldStore;

  beforeAll(async () => {
    api = await world.start();
    holds = api.app.get(HoldStore);
  });
  afterAll(() => world.cleanup());

  const reserve = (pool: string, body: Record<string, unknown>) => api.post(`/v1/pools/${pool}/reservations`, body);
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

  it('the item freed goes to the waiter that began first, whichever tries first; then to the next', async () => {
    await seedPool(api, 'turns', numbers(1));
    const [blocker] = await holdAll('turns', 1);
    const first = request('turns', 'first', 1, true);
    const second = request('turns', 'second', 1, true);
    expect(await holds.reserve('turns', first)).toEqual({ status: 'exhausted', limited: false });
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1 });
    await release(blocker);
    // The item is free, but it is the first waiter's: the second's try, and a reserve that does not wait, get 409.
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false, waitersAhead: 1 });
    const plain = await reserve('turns', { owner: 'plain', count: 1 });
    expect(plain.status).toBe(409);
    expect(plain.body.error).toMatchObject({ code: 'POOL_EXHAUSTED', details: { count: 1, waitersAhead: 2 } });
    const served = await holds.reserve('turns', first);
    expect(served.status).toBe('ok');
    // Served, the first has left the line: the second is next when the item comes back.
    expect(await holds.reserve('turns', second)).toEqual({ status: 'exhausted', limited: false });
    await release(first.reservationId);
    expect((await holds.reserve('turns', second)).status).toBe('ok');
    await release(second.reservationId);
    expect((await reserve('turns', { owner: 'plain', count: 1 })).status).toBe(201);
  });

  it('over HTTP: two callers waiting for one item are served in the order they came', async () => {
    await seedPool(api, 'order', numbers(1));
    const [blocker] = await holdAll('order', 1);
    const answers: string[] = [];
    const wait = (owner: string) =>
      reserve('order', { owner, count: 1, waitMs: 8_000 }).then((r) => {
        answers.push(owner);
        return r;
      });
    const early = wait('early');
    await sleep(150);
    const late = wait('late');
    await sleep(400);
    await release(blocker);
    const got = await early;
    expect(got.status).toBe(201);
    expect(answers).toEqual(['early']);
    await release(got.body.id);
    expect((await late).status).toBe(201);
    expect(answers).toEqual(['early', 'late']);
  });

  it('first fit: a later waiter gets the items an earlier one cannot use yet, and no more', async () => {
    await seedPool(api, 'fit', numbers(4));
    const held = await holdAll('fit', 4);
    const big = request('fit', 'big', 3, true);
    const small = request('fit', 'small', 1, true);
    expect((await holds.reserve('fit', big)).status).toBe('exhausted');
    expect((await holds.reserve('fit', small)).status).toBe('exhausted');
    await release(held[0]);
    // One free: the waiter for 3 cannot use it, so the waiter for 1 behind it gets it.
    expect((await holds.reserve('fit', small)).status).toBe('ok');
    await release(held[1]);
    await release(held[2]);
    await release(held[3]);
    // Three free, and the waiter for 3 is first: nothing for a reserve that does not wait.
    const plain = await reserve('fit', { owner: 'plain', count: 1 });
    expect(plain.body.error).toMatchObject({ code: 'POOL_EXHAUSTED', details: { waitersAhead: 1 } });
    expect((await holds.reserve('fit', big)).status).toBe('ok');
    expect(await api.stats('fit')).toEqual({ total: 4, free: 0, held: 4, allocated: 0 });
  });

  it('a waiter that gives up leaves the line at once; one that stops trying (its instance died) loses its place', async () => {
    await seedPool(api, 'leave', numbers(1));
    const [blocker] = await holdAll('leave', 1);
    const gaveUp = await reserve('leave', { owner: 'gave-up', count: 1, waitMs: 300 });
    expect(gaveUp.status).toBe(409);
    await release(blocker);
    const next = await reserve('leave', { owner: 'next', count: 1 });
    expect(next.status).toBe(201);
    // A waiter whose instance died: its last try put it in the line, and nothing takes it out.
    const dead = request('leave', 'dead', 1, true);
    expect((await holds.reserve('leave', dead)).status).toBe('exhausted');
    await release(next.body.id);
    const started = Date.now();
    expect((await reserve('leave', { owner: 'plain', count: 1 })).body.error).toMatchObject({ details: { waitersAhead: 1 } });
    await sleep(WAIT_PLACE_MS + 100 - (Date.now() - started));
    // Within 2 s of its release (DESIGN.md invariant 4), the item is anyone's again.
    expect((await reserve('leave', { owner: 'plain', count: 1 })).status).toBe(201);
    expect(Date.now() - started).toBeLessThan(2_000);
  });

  it('each filter has its own line; filters with several conditions take no turn', async () => {
    const city = (c: string, n: number) => numbers(n, `139${c === 'bj' ? 1 : 2}000`).map((value) => ({ value, attributes: { city: c } }));
    await seedPool(api, 'lines', [...city('bj', 1), ...city('sh', 1)]);
    const held = await holdAll('lines', 2);
    const bj = request('lines', 'bj-waiter', 1, true, { attributes: { city: 'bj' } });
    expect((await holds.reserve('lines', bj)).status).toBe('exhausted');
    await release(held[0]);
    await release(held[1]);
    // The bj waiter is first for bj items and for no others.
    const plainBj = await reserve('lines', { owner: 'plain', count: 1, filter: { attributes: { city: 'bj' } } });
    expect(plainBj.body.error).toMatchObject({ details: { waitersAhead: 1 } });
    const plainSh = await reserve('lines', { owner: 'plain', count: 1, filter: { attributes: { city: 'sh' } } });
    expect(plainSh.status).toBe(201);
    // A filter of an attribute and a prefix takes no turn.
    expect(waitingLine({ kind: 'r', attributes: { city: 'bj' }, valuePrefix: '139' })).toBe('');
    const both = await reserve('lines', { owner: 'plain', count: 1, filter: { attributes: { city: 'bj' }, valuePrefix: '1391' } });
    expect(both.status).toBe(201);
    expect((await holds.reserve('lines', bj)).status).toBe('exhausted');
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
