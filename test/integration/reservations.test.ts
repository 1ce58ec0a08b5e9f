import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { freeMember, poolKeys } from '../../src/redis/keys.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { RebuildService } from '../../src/sweeper/rebuild.service.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm } from '../support/harness.js';

/** A hold-time answer's `receivedAt`: when the instance received the request, so between its sending and its answer. */
function expectReceivedBetween(receivedAt: string, sentAt: number, answeredAt: number): void {
  expect(receivedAt).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
  // Date.now() and the ISO string both have whole milliseconds.
  expect(Date.parse(receivedAt)).toBeGreaterThanOrEqual(sentAt);
  expect(Date.parse(receivedAt)).toBeLessThanOrEqual(answeredAt);
}

describe('reservations', () => {
  const world = new TestWorld('reservations');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  const reserve = (pool: string, body: Record<string, unknown>, headers?: Record<string, string>) =>
    api.post(`/v1/pools/${pool}/reservations`, body, headers);
  const dbRow = async (id: string) => (await world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [id]))[0];

  it('reserve 3, confirm 1: the chosen one is allocated, the other two are free again at once', async () => {
    await seedPool(api, 'flow', numbers(3));
    const r = await reserve('flow', { owner: 'user-123', count: 3, ttlMs: 900_000 });
    expect(r.status).toBe(201);
    expect(r.body).toMatchObject({ pool: 'flow', owner: 'user-123', state: 'held' });
    expect(r.body.id).toMatch(/^flow\.[0-9a-f-]{36}$/);
    expect(r.body.items).toHaveLength(3);
    const expiresIn = Date.parse(r.body.expiresAt) - Date.now();
    expect(expiresIn).toBeGreaterThan(890_000);
    expect(expiresIn).toBeLessThan(910_000);
    expect(await api.stats('flow')).toEqual({ total: 3, free: 0, held: 3, allocated: 0 });

    const [chosen, ...others] = r.body.items;
    const confirmed = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen.resourceId] });
    expect(confirmed.status).toBe(200);
    expect(confirmed.body).toEqual({
      id: r.body.id,
      state: 'confirmed',
      allocated: [{ resourceId: chosen.resourceId, value: chosen.value, version: chosen.version + 1 }],
      released: others.map((i: { resourceId: string }) => i.resourceId),
    });
    expect(await api.stats('flow')).toEqual({ total: 3, free: 2, held: 0, allocated: 1 });
    expect(await dbRow(chosen.resourceId)).toEqual({ state: 2, version: chosen.version + 1, owner: 'user-123' });

    const again = await reserve('flow', { owner: 'user-456', count: 2 });
    expect(again.status).toBe(201);
    expect(again.body.items.map((i: { resourceId: string }) => i.resourceId).sort()).toEqual(
      others.map((i: { resourceId: string }) => i.resourceId).sort(),
    );

    const read = await api.get(`/v1/reservations/${r.body.id}`);
    expect(read.body).toMatchObject({ state: 'confirmed', allocated: confirmed.body.allocated, released: confirmed.body.released });
    const resource = await api.get(`/v1/pools/flow/resources/${chosen.resourceId}`);
    expect(resource.body).toMatchObject({ state: 'allocated', owner: 'user-123', version: chosen.version + 1 });
  });

  it('all or nothing: a reserve asking for more than are free (or match) is 409 POOL_EXHAUSTED and holds none of them', async () => {
    await seedPool(api, 'all-or-none', [{ value: '13800000001' }, { value: '13800000002' }, { value: '13900000003' }]);
    const tooMany = await reserve('all-or-none', { owner: 'a', count: 4 });
    expect(tooMany.status).toBe(409);
    expect(tooMany.body.error.code).toBe('POOL_EXHAUSTED');
    const tooManyByPrefix = await reserve('all-or-none', { owner: 'a', count: 3, filter: { valuePrefix: '138' } });
    expect(tooManyByPrefix.body.error.code).toBe('POOL_EXHAUSTED');
    expect(await api.stats('all-or-none')).toEqual({ total: 3, free: 3, held: 0, allocated: 0 });

    // Every item the failed reserves looked at is still free and unheld: a reserve of all of them gets them.
    const all = await reserve('all-or-none', { owner: 'b', count: 3 });
    expect(all.status).toBe(201);
    expect(all.body.items.map((i: { value: string }) => i.value).sort()).toEqual(['13800000001', '13800000002', '13900000003']);
  });

  it('an index entry that does not match its item (a value or attribute it lacks) is never handed out: it is dropped and the reserve ends', async () => {
    await seedPool(api, 'skewed', [{ value: '13800000001', attributes: { city: 'sh' } }]);
    const redis = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'skewed');
    const [member] = await redis.zrange(keys.free, 0, -1);
    const id = member.slice(member.indexOf('\0') + 1);
    const wrongValue = freeMember('13899999999', id);
    const wrongCity = keys.attribute('city', 'bj');
    const swapEntry = () => redis.multi().zrem(keys.free, member).zadd(keys.free, 0, wrongValue).exec();
    // Each skew is met by one way of picking: random picks, value-prefix pages, an attribute index's picks. The
    // item matches neither the prefix nor the attribute its wrong entries claim, so even 1 of it is not there.
    const cases = [
      { skew: swapEntry, count: 2, filter: undefined },
      { skew: swapEntry, count: 1, filter: { valuePrefix: '1389' } },
      { skew: () => redis.zadd(wrongCity, 0, member), count: 1, filter: { attributes: { city: 'bj' } } },
    ];
    for (const { skew, count, filter } of cases) {
      await skew();
      const r = await reserve('skewed', { owner: 'a', count, ...(filter && { filter }) });
      expect(r.status, JSON.stringify(filter)).toBe(409);
      expect(r.body.error.code).toBe('POOL_EXHAUSTED');
      // The wrong entry is gone and the item is indexed under its own entry again, unheld.
      expect(await redis.zrange(keys.free, 0, -1)).toEqual([member]);
      expect(await redis.zrange(wrongCity, 0, -1)).toEqual([]);
      expect(await redis.exists(keys.hold(id))).toBe(0);
    }
    const r = await reserve('skewed', { owner: 'b', count: 1 });
    expect(r.status).toBe(201);
    expect(r.body.items[0].value).toBe('13800000001');
  });

  it('an item whose cached JSON is not an item (a hand edit) is left out, not a 500: the reserve takes others, and the rebuild restores it', async () => {
    await seedPool(api, 'garbled', numbers(4));
    const redis = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'garbled');
    const members = await redis.zrange(keys.free, 0, -1);
    const ids = members.map((m) => m.slice(m.indexOf('\0') + 1));
    await redis.hset(keys.itemBucket(ids[0]), ids[0], 'not json');
    await redis.hset(keys.itemBucket(ids[1]), ids[1], JSON.stringify({ id: ids[1], n: 0 })); // no value
    // A reserve of all 4 meets both: 409 (2 are items), not a 500, and the 2 go back.
    const all = await reserve('garbled', { owner: 'o', count: 4 });
    expect(all.status).toBe(409);
    expect(all.body.error.code).toBe('POOL_EXHAUSTED');
    // The garbled ones are out of the index, not held, and their cache entries are gone.
    expect((await redis.zrange(keys.free, 0, -1)).sort()).toEqual(members.slice(2).sort());
    expect(await redis.exists(keys.hold(ids[0]), keys.hold(ids[1]))).toBe(0);
    expect(await redis.hget(keys.itemBucket(ids[0]), ids[0])).toBeNull();
    expect(await redis.hget(keys.itemBucket(ids[1]), ids[1])).toBeNull();
    const r = await reserve('garbled', { owner: 'o', count: 2 });
    expect(r.status).toBe(201);
    expect(r.body.items.map((i: { resourceId: string }) => i.resourceId).sort()).toEqual(ids.slice(2).sort());
    expect(await api.app.get(RebuildService).rebuild('periodic')).toBe(2);
    const again = await reserve('garbled', { owner: 'o', count: 2 });
    expect(again.status).toBe(201);
    expect(again.body.items.map((i: { resourceId: string }) => i.resourceId).sort()).toEqual(ids.slice(0, 2).sort());
  });

  it('a wrong entry met while walking windows by rank does not make the walk skip a match: its item is indexed afterwards', async () => {
    // 64 items under the prefix, and a 65th whose entry names an old value under it while its item's value is
    // now below it (as if changed in Postgres and cached, with the index not repaired). Its own entry, indexed
    // at once, would sort first and move every member after it up one rank.
    const values = Array.from({ length: 64 }, (_, i) => `139000000${String(i).padStart(2, '0')}`);
    await seedPool(
      api,
      'reindexed',
      [...values, '13999999999'].map((value) => ({ value, attributes: { city: 'bj' } })),
    );
    const redis = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'reindexed');
    const city = keys.attribute('city', 'bj');
    const [stale] = await redis.zrangebylex(keys.free, '[13999999999', '+');
    const id = stale.slice(stale.indexOf('\0') + 1);
    const item = JSON.parse((await redis.hget(keys.itemBucket(id), id))!);
    await redis.hset(keys.itemBucket(id), id, JSON.stringify({ ...item, v: '13800000000' }));
    const filter = { attributes: { city: 'bj' }, valuePrefix: '139' };
    // The windows' order is random: each round meets the wrong entry first about half the time.
    let met = 0;
    for (let round = 0; round < 16; round++) {
      const own = freeMember('13800000000', id);
      await redis.multi().zrem(keys.free, own).zrem(city, own).zadd(keys.free, 0, stale).zadd(city, 0, stale).exec();
      const r = await reserve('reindexed', { owner: 'o', count: 64, filter });
      expect(r.status, `round ${round}`).toBe(201);
      expect(r.body.items.map((i: { value: string }) => i.value).sort()).toEqual(values);
      // Met, the wrong entry is gone and the item is indexed under its own; else both are as they were.
      const left = await redis.zrange(city, 0, -1);
      expect([[own], [stale]]).toContainEqual(left);
      if (left[0] === own) met++;
      expect((await api.del(`/v1/reservations/${r.body.id}`)).status).toBe(200);
    }
    expect(met).toBeGreaterThan(0);
  });

  it('an item met behind a wrong entry and then taken under its own entry by the same walk is not indexed again: it is held', async () => {
    await seedPool(api, 'met-twice', [
      { value: '138a', attributes: { city: 'bj' } },
      { value: '138b', attributes: { city: 'bj' } },
    ]);
    const redis = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'met-twice');
    const [{ id }] = await world.query(`SELECT id::text AS id FROM t_resource WHERE value = '138a'`);
    // An entry naming another value for the item, which sorts before its own: one window meets both, in this order.
    await redis.zadd(keys.attribute('city', 'bj'), 0, freeMember('138', id));
    const r = await reserve('met-twice', { owner: 'u', count: 2, filter: { attributes: { city: 'bj' }, valuePrefix: '138' } });
    expect(r.status).toBe(201);
    expect(await redis.zcard(keys.free)).toBe(0);
    expect(await redis.zcard(keys.attribute('city', 'bj'))).toBe(0);
    expect(await api.stats('met-twice')).toEqual({ total: 2, free: 0, held: 2, allocated: 0 });
  });

  it('confirm is idempotent; a different selection afterwards is RESERVATION_CLOSED', async () => {
    await seedPool(api, 'idem-confirm', numbers(3));
    const r = await reserve('idem-confirm', { owner: 'payer', count: 3 });
    const ids = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    const first = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [ids[1]] });
    const retry = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [ids[1]] });
    expect(first.status).toBe(200);
    expect(retry.status).toBe(200);
    expect(retry.body).toEqual(first.body);
    const other = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [ids[0]] });
    expect(other.status).toBe(409);
    expect(other.body.error.code).toBe('RESERVATION_CLOSED');
    expect(await dbRow(ids[0])).toMatchObject({ state: 1, version: 0 });
    const history = await world.query(`SELECT count(*)::int AS n FROM t_allocation_history WHERE resource_id = $1`, [ids[1]]);
    expect(history[0].n).toBe(1);
  });

  it('confirm naming an item the reservation does not hold is 422 NOT_IN_RESERVATION and changes nothing', async () => {
    await seedPool(api, 'notin', numbers(4));
    const r = await reserve('notin', { owner: 'payer', count: 2 });
    const held = new Set(r.body.items.map((i: { resourceId: string }) => i.resourceId));
    const [stranger] = (await world.query(`SELECT r.id::text FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'notin'`))
      .map((row) => row.id)
      .filter((id) => !held.has(id));
    const answer = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId, stranger] });
    expect(answer.status).toBe(422);
    expect(answer.body.error).toMatchObject({ code: 'NOT_IN_RESERVATION', details: { resourceId: stranger } });
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
    expect(await api.stats('notin')).toEqual({ total: 4, free: 2, held: 2, allocated: 0 });
  });

  it('DELETE releases the held items at once and is idempotent; confirm afterwards is RESERVATION_CLOSED', async () => {
    await seedPool(api, 'release', numbers(2));
    const r = await reserve('release', { owner: 'walker', count: 2 });
    // It takes no body: a field is refused like any unknown one, and releases nothing.
    const withBody = await api.request('DELETE', `/v1/reservations/${r.body.id}`, { force: true });
    expect(withBody.status).toBe(400);
    expect(withBody.body.error.details.fields).toEqual([{ field: 'force', reason: 'property force should not exist' }]);
    // Nor a JSON null: it is not the empty object the route accepts.
    const withNull = await api.request('DELETE', `/v1/reservations/${r.body.id}`, null);
    expect(withNull.status).toBe(400);
    expect(withNull.body.error.details.fields).toEqual([{ field: 'body', reason: 'this route takes no body (or {})' }]);
    expect(await api.stats('release')).toEqual({ total: 2, free: 0, held: 2, allocated: 0 });
    const released = await api.del(`/v1/reservations/${r.body.id}`);
    expect(released.status).toBe(200);
    expect(released.body.state).toBe('released');
    expect(await api.stats('release')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    const again = await api.del(`/v1/reservations/${r.body.id}`);
    expect(again.status).toBe(200);
    expect(again.body.state).toBe('released');
    const late = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(late.status).toBe(409);
    expect(late.body.error.code).toBe('RESERVATION_CLOSED');
    expect((await reserve('release', { owner: 'next', count: 2 })).status).toBe(201);
  });

  it('while a confirm commits, extend and DELETE are 409 RESERVATION_CLOSED with details.confirmInProgress; once it landed, without', async () => {
    await seedPool(api, 'committing', numbers(2, '1391000'));
    const r = await reserve('committing', { owner: 'u', count: 2 });
    const chosen = r.body.items[0].resourceId;
    const confirm = await stalledConfirm(api, 'committing', r.body.id, chosen, 30_000);
    for (const answer of [
      await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 60_000 }),
      await api.del(`/v1/reservations/${r.body.id}`),
    ]) {
      expect(answer.status).toBe(409);
      expect(answer.body.error).toMatchObject({ code: 'RESERVATION_CLOSED', details: { id: r.body.id, confirmInProgress: true } });
    }
    expect(await confirm.land()).toBe('committed');
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen] })).status).toBe(200);
    const closed = await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 60_000 });
    expect(closed.body.error.code).toBe('RESERVATION_CLOSED');
    expect(closed.body.error.details).toEqual({ id: r.body.id });
  });

  it('extend moves expiresAt to now + ttlMs, capped by maxHoldTtlMs; once expired it is HOLD_EXPIRED', async () => {
    await seedPool(api, 'extend', numbers(2), { holdTtlMs: 1000, maxHoldTtlMs: 20_000 });
    const r = await reserve('extend', { owner: 'slow', count: 1 });
    const extended = await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 10_000 });
    expect(extended.status).toBe(200);
    const ahead = Date.parse(extended.body.expiresAt) - Date.now();
    expect(ahead).toBeGreaterThan(8_000);
    expect(ahead).toBeLessThanOrEqual(10_500);
    const capped = await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 3_600_000 });
    expect(Date.parse(capped.body.expiresAt) - Date.now()).toBeLessThanOrEqual(20_500);
    // The hold itself outlives expiresAt by the grace, as at reserve.
    const hold = poolKeys(world.prefix, 'extend').hold(r.body.items[0].resourceId);
    const holdEnd = Date.now() + (await api.app.get<Redis>(REDIS).pttl(hold));
    expect(Math.abs(holdEnd - Date.parse(capped.body.expiresAt) - api.config.HOLD_GRACE_MS)).toBeLessThan(250);

    const short = await reserve('extend', { owner: 'late', count: 1, ttlMs: 1000 });
    await sleep(1200);
    const sentAt = Date.now();
    const tooLate = await api.post(`/v1/reservations/${short.body.id}/extend`, { ttlMs: 5000 });
    expect(tooLate.status).toBe(409);
    expect(tooLate.body.error.code).toBe('HOLD_EXPIRED');
    expectReceivedBetween(tooLate.body.error.details.receivedAt, sentAt, Date.now());
  });

  it('invariant 4: a hold with ttlMs 1000 is reservable again within 2 s of its expiry and reads expired', async () => {
    await seedPool(api, 'expiry', numbers(1));
    const r = await reserve('expiry', { owner: 'gone', count: 1, ttlMs: 1000 });
    expect(r.status).toBe(201);
    expect((await reserve('expiry', { owner: 'other', count: 1 })).body.error.code).toBe('POOL_EXHAUSTED');
    const expiresAt = Date.parse(r.body.expiresAt);
    const { value } = await eventually(
      async () => {
        const again = await reserve('expiry', { owner: 'other', count: 1 });
        return again.status === 201 ? again : null;
      },
      4000,
      50,
    );
    expect(Date.now() - expiresAt).toBeLessThan(2000);
    expect(value.body.items[0].resourceId).toBe(r.body.items[0].resourceId);
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('expired');
    expect((await api.get('/metrics')).body).toContain('respool_expired_holds_total{pool="expiry"} 1');
  });

  it('a confirm after expiry succeeds for an item nobody took meanwhile', async () => {
    await seedPool(api, 'late-ok', numbers(2));
    const r = await reserve('late-ok', { owner: 'tardy', count: 2, ttlMs: 1000 });
    await eventually(async () => (await api.get(`/v1/reservations/${r.body.id}`)).body.state === 'expired', 3000);
    await eventually(async () => (await api.stats('late-ok')).free === 2, 3000);
    const chosen = r.body.items[0];
    const confirmed = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen.resourceId] });
    expect(confirmed.status).toBe(200);
    expect(confirmed.body.allocated[0]).toEqual({ resourceId: chosen.resourceId, value: chosen.value, version: chosen.version + 1 });
    expect(await dbRow(chosen.resourceId)).toEqual({ state: 2, version: chosen.version + 1, owner: 'tardy' });
    expect(await api.stats('late-ok')).toEqual({ total: 2, free: 1, held: 0, allocated: 1 });
  });

  it('a confirm after expiry of an item someone else now holds is HOLD_LOST and allocates nothing', async () => {
    await seedPool(api, 'late-lost', numbers(1));
    const r = await reserve('late-lost', { owner: 'tardy', count: 1, ttlMs: 1000 });
    const { value: thief } = await eventually(async () => {
      const t = await reserve('late-lost', { owner: 'thief', count: 1 });
      return t.status === 201 ? t : null;
    }, 4000);
    // The confirm takes its time inside the service (300 ms before its pin): the answer still says when it arrived.
    const holds = api.app.get(HoldStore);
    const pin = holds.pin.bind(holds);
    const slow = vi.spyOn(holds, 'pin').mockImplementationOnce(async (...args) => (await sleep(300), pin(...args)));
    const sentAt = Date.now();
    const lost = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    const answeredAt = Date.now();
    slow.mockRestore();
    expect(lost.status).toBe(409);
    expect(lost.body.error.code).toBe('HOLD_LOST');
    // When the instance received the confirm: after the hold's expiresAt, which is why it could be lost.
    expectReceivedBetween(lost.body.error.details.receivedAt, sentAt, answeredAt - 300);
    expect(Date.parse(lost.body.error.details.receivedAt)).toBeGreaterThan(Date.parse(r.body.expiresAt));
    expect((await api.get('/metrics')).body).toMatch(/respool_confirm_conflicts_total\{reason="hold_taken"\} [1-9]/);
    expect(await dbRow(r.body.items[0].resourceId)).toEqual({ state: 1, version: 0, owner: null });
    // The new holder still gets it.
    const won = await api.post(`/v1/reservations/${thief.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
    expect(won.status).toBe(200);
    expect(await dbRow(r.body.items[0].resourceId)).toEqual({ state: 2, version: 1, owner: 'thief' });
  });

  it('a confirm after expiry of an item someone else allocated and released meanwhile is HOLD_LOST (the version moved on)', async () => {
    await seedPool(api, 'aba', numbers(1));
    const r = await reserve('aba', { owner: 'tardy', count: 1, ttlMs: 1000 });
    const id = r.body.items[0].resourceId;
    const { value: other } = await eventually(async () => {
      const t = await reserve('aba', { owner: 'quick', count: 1 });
      return t.status === 201 ? t : null;
    }, 4000);
    expect((await api.post(`/v1/reservations/${other.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    expect((await api.post(`/v1/pools/aba/resources/${id}/release`, { owner: 'quick' })).status).toBe(200);
    // Taken and returned between the hold and the confirm: the version check refuses it (the ABA case).
    const lost = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] });
    expect(lost.status).toBe(409);
    expect(lost.body.error.code).toBe('HOLD_LOST');
    expect(await dbRow(id)).toEqual({ state: 1, version: 2, owner: null });
    // Nothing leaked: the item is reservable again, with its current version.
    const fresh = await reserve('aba', { owner: 'next', count: 1 });
    expect(fresh.status).toBe(201);
    expect(fresh.body.items[0]).toMatchObject({ resourceId: id, version: 2 });
  });

  it('Idempotency-Key: the same call returns the same reservation with 200; a different body is IDEMPOTENCY_KEY_REUSED', async () => {
    await seedPool(api, 'idem', numbers(5));
    const body = { owner: 'front', count: 2 };
    const first = await reserve('idem', body, { 'Idempotency-Key': 'order-1' });
    const repeat = await reserve('idem', body, { 'Idempotency-Key': 'order-1' });
    expect(first.status).toBe(201);
    expect(repeat.status).toBe(200);
    expect(repeat.body).toEqual(first.body);
    expect(await api.stats('idem')).toMatchObject({ free: 3, held: 2 });
    const reused = await reserve('idem', { owner: 'front', count: 3 }, { 'Idempotency-Key': 'order-1' });
    expect(reused.status).toBe(409);
    expect(reused.body.error.code).toBe('IDEMPOTENCY_KEY_REUSED');
    expect(await api.stats('idem')).toMatchObject({ free: 3, held: 2 });
    const badKey = await reserve('idem', body, { 'Idempotency-Key': 'x'.repeat(300) });
    expect(badKey.status).toBe(400);
  });

  it('maxHoldsPerOwner: an owner over the quota gets 429 OWNER_QUOTA_EXCEEDED, other owners are unaffected', async () => {
    await seedPool(api, 'quota', numbers(6), { maxHoldsPerOwner: 2 });
    expect((await reserve('quota', { owner: 'greedy', count: 2 })).status).toBe(201);
    const over = await reserve('quota', { owner: 'greedy', count: 1 });
    expect(over.status).toBe(429);
    expect(over.body.error.code).toBe('OWNER_QUOTA_EXCEEDED');
    expect((await reserve('quota', { owner: 'modest', count: 2 })).status).toBe(201);
    expect(await api.stats('quota')).toMatchObject({ free: 2, held: 4 });
  });

  it('maxHoldsPerOwner: holds stop counting once released, expired or confirmed, and only once', async () => {
    await seedPool(api, 'quota-back', numbers(8), { maxHoldsPerOwner: 3 });
    const owner = 'returning';
    const held = async () => {
      const probe = await reserve('quota-back', { owner, count: 3 });
      if (probe.status === 201) await api.del(`/v1/reservations/${probe.body.id}`);
      return probe.status === 201 ? 0 : 'some';
    };
    // Released, twice: counted off once.
    const released = await reserve('quota-back', { owner, count: 2 });
    expect((await reserve('quota-back', { owner, count: 2 })).status).toBe(429);
    expect((await api.del(`/v1/reservations/${released.body.id}`)).status).toBe(200);
    expect((await api.del(`/v1/reservations/${released.body.id}`)).status).toBe(200);
    expect(await held()).toBe(0);

    // Expired, then confirmed late (its items were still free), while the owner holds 1 more: the sweep and
    // the late confirm each end the reservation, and its 2 holds must come off once, not twice.
    const expiring = await reserve('quota-back', { owner, count: 2, ttlMs: 1000 });
    // The sweeper has run once the 2 items are free again (a read says "expired" as soon as the time is up).
    await eventually(async () => (await api.stats('quota-back')).free === 8, 4000);
    const other = await reserve('quota-back', { owner, count: 1 });
    expect(other.status).toBe(201);
    // Its items were free again: confirm one that the reserve just now did not take.
    const taken = other.body.items[0].resourceId;
    const untaken = expiring.body.items.map((i: { resourceId: string }) => i.resourceId).find((id: string) => id !== taken);
    const late = await api.post(`/v1/reservations/${expiring.body.id}/confirm`, { resourceIds: [untaken] });
    expect(late.status).toBe(200);
    // The owner holds 1: 2 more fit, 3 do not.
    expect((await reserve('quota-back', { owner, count: 3 })).status).toBe(429);
    const two = await reserve('quota-back', { owner, count: 2 });
    expect(two.status).toBe(201);
    expect(await api.stats('quota-back')).toMatchObject({ free: 4, held: 3, allocated: 1 });
  });

  it('filters: by attributes, by value prefix, and both', async () => {
    await seedPool(api, 'filters', [
      { value: '13800000001', attributes: { city: 'bj', tier: 'gold' } },
      { value: '13800000002', attributes: { city: 'bj' } },
      { value: '13900000003', attributes: { city: 'bj', tier: 'gold' } },
      { value: '13900000004', attributes: { city: 'sh' } },
    ]);
    const gold = await reserve('filters', { owner: 'a', count: 2, filter: { attributes: { city: 'bj', tier: 'gold' } } });
    expect(gold.body.items.map((i: { value: string }) => i.value).sort()).toEqual(['13800000001', '13900000003']);
    await api.del(`/v1/reservations/${gold.body.id}`);
    const both = await reserve('filters', { owner: 'b', count: 1, filter: { attributes: { city: 'bj' }, valuePrefix: '139' } });
    expect(both.body.items[0].value).toBe('13900000003');
    const prefix = await reserve('filters', { owner: 'c', count: 2, filter: { valuePrefix: '138' } });
    expect(prefix.body.items.map((i: { value: string }) => i.value).sort()).toEqual(['13800000001', '13800000002']);
    const none = await reserve('filters', { owner: 'd', count: 2, filter: { attributes: { city: 'sh' } } });
    expect(none.status).toBe(409);
    expect(none.body.error.code).toBe('POOL_EXHAUSTED');
    expect(await api.stats('filters')).toMatchObject({ free: 1, held: 3 });
  });

  /** A pool of n items valued `<prefix><i in 7 digits>`, item i with the attributes `attributesOf(i)`. */
  const seedNumbered = (pool: string, n: number, prefix: string, attributesOf: (i: number) => Record<string, string>) =>
    seedPool(
      api,
      pool,
      Array.from({ length: n }, (_, i) => ({ value: `${prefix}${String(i).padStart(7, '0')}`, attributes: attributesOf(i) })),
    );

  it('filters with several conditions find their matches among hundreds of candidates: by intersection, or in value order', async () => {
    const upTo = (n: number) => Array.from({ length: n }, (_, i) => i);
    // Two attributes of about 200 items each that share 3: Redis counts the intersection, and the script
    // reads it whole.
    await seedNumbered('walk-sets', 400, '1380', (i) => ({ ...(i < 200 && { a: 'x' }), ...(i >= 197 && { b: 'y' }) }));
    const sets = await reserve('walk-sets', { owner: 'o', count: 3, filter: { attributes: { a: 'x', b: 'y' } } });
    expect(sets.status).toBe(201);
    const numbered = sets.body.items.map((item: { value: string }) => Number(item.value.slice(4)));
    expect(numbered.sort((x: number, y: number) => x - y)).toEqual([197, 198, 199]);
    expect((await reserve('walk-sets', { owner: 'o', count: 1, filter: { attributes: { a: 'x', b: 'y' } } })).body.error.code).toBe(
      'POOL_EXHAUSTED',
    );

    // Two attributes of 800 and 600 items sharing 300, more than the script reads whole: it reads the smaller
    // one's index a window at a time. Three reserves of 100 take exactly the 300; a fourth finds none.
    await seedNumbered('walk-dense', 1100, '1381', (i) => ({ ...(i < 800 && { a: 'x' }), ...(i >= 500 && { b: 'y' }) }));
    const taken: number[] = [];
    for (let i = 0; i < 3; i++) {
      const dense = await reserve('walk-dense', { owner: 'o', count: 100, filter: { attributes: { a: 'x', b: 'y' } } });
      expect(dense.status).toBe(201);
      taken.push(...dense.body.items.map((item: { value: string }) => Number(item.value.slice(4))));
    }
    expect(taken.sort((x, y) => x - y)).toEqual(upTo(300).map((i) => 500 + i));
    expect((await reserve('walk-dense', { owner: 'o', count: 1, filter: { attributes: { a: 'x', b: 'y' } } })).body.error.code).toBe(
      'POOL_EXHAUSTED',
    );

    // A value prefix matching 150 items, of which only the last 3 by value have the attribute, which 253 items
    // have: the prefix's range of the attribute's index holds exactly those 3.
    const value = (i: number) => `${i < 150 ? '139' : '138'}${String(i).padStart(8, '0')}`;
    await seedPool(
      api,
      'walk-range',
      upTo(400).map((i) => ({ value: value(i), attributes: { c: i < 147 ? 'other' : 'z', ...(i >= 140 && i < 160 && { d: 'w' }) } })),
    );
    const filter = { attributes: { c: 'z' }, valuePrefix: '139' };
    const range = await reserve('walk-range', { owner: 'o', count: 3, filter });
    expect(range.status).toBe(201);
    expect(range.body.items.map((item: { value: string }) => item.value).sort()).toEqual([147, 148, 149].map(value));
    expect((await reserve('walk-range', { owner: 'o', count: 1, filter })).body.error.code).toBe('POOL_EXHAUSTED');
    expect(await api.stats('walk-range')).toMatchObject({ free: 397, held: 3 });

    // An attribute of 20 items, 10 of them under the same prefix, 7 of those free (147-149 are held above):
    // asking 8 takes and gives back 7.
    const small = { attributes: { d: 'w' }, valuePrefix: '139' };
    expect((await reserve('walk-range', { owner: 'o', count: 8, filter: small })).body.error.code).toBe('POOL_EXHAUSTED');
    expect(await api.stats('walk-range')).toMatchObject({ free: 397, held: 3 });
    const seven = await reserve('walk-range', { owner: 'o', count: 7, filter: small });
    expect(seven.status).toBe(201);
    expect(seven.body.items.map((item: { value: string }) => item.value).sort()).toEqual(upTo(7).map((i) => value(140 + i)));
  });

  it('two attributes and a prefix matching 200 of 600 items spread over every window the script reads: two reserves of 100 take all 200', async () => {
    // Each attribute lists 400 items and both list every third one. The script reads one attribute's 400 in
    // windows, in random order, and the items it takes move the later windows: none may be skipped.
    await seedNumbered('windows', 600, '1370', (i) => ({ ...(i % 3 !== 2 && { b: 'y' }), ...(i % 3 !== 1 && { c: 'z' }) }));
    const filter = { attributes: { b: 'y', c: 'z' }, valuePrefix: '1370' };
    const taken: number[] = [];
    for (let i = 0; i < 2; i++) {
      const r = await reserve('windows', { owner: 'o', count: 100, filter });
      expect(r.status).toBe(201);
      taken.push(...r.body.items.map((item: { value: string }) => Number(item.value.slice(4))));
    }
    expect(taken.sort((x, y) => x - y)).toEqual(Array.from({ length: 200 }, (_, i) => 3 * i));
    expect((await reserve('windows', { owner: 'o', count: 1, filter })).body.error.code).toBe('POOL_EXHAUSTED');
  });

  it('takes attributes named "constructor" or "toString" as data, on import and in a filter', async () => {
    await seedPool(api, 'ctor', [
      { value: '13700000001', attributes: { constructor: 'x' } },
      { value: '13700000002', attributes: { toString: 'y' } },
      { value: '13700000003' },
    ]);
    const held = await reserve('ctor', { owner: 'a', filter: { attributes: { constructor: 'x' } } });
    expect(held.status).toBe(201);
    expect(held.body.items[0]).toMatchObject({ value: '13700000001', attributes: { constructor: 'x' } });
    expect((await reserve('ctor', { owner: 'b', filter: { attributes: { constructor: 'x' } } })).status).toBe(409);
    const other = await reserve('ctor', { owner: 'c', filter: { attributes: { toString: 'y' } } });
    expect(other.body.items[0]).toMatchObject({ value: '13700000002', attributes: { toString: 'y' } });
    expect((await reserve('ctor', { owner: 'd', filter: { attributes: { toString: 'y' } } })).status).toBe(409);
  });

  it('invariant 6: bad input is a 400 VALIDATION_FAILED listing each field, and changes nothing', async () => {
    await seedPool(api, 'strict', numbers(3), { holdTtlMs: 30_000, maxHoldTtlMs: 60_000 });
    const cases: [Record<string, unknown>, string][] = [
      [{ count: 1 }, 'owner'],
      [{ owner: '', count: 1 }, 'owner'],
      [{ owner: 'x'.repeat(129) }, 'owner'],
      [{ owner: 'u', count: 0 }, 'count'],
      [{ owner: 'u', count: 101 }, 'count'],
      [{ owner: 'u', count: 1.5 }, 'count'],
      [{ owner: 'u', ttlMs: 999 }, 'ttlMs'],
      [{ owner: 'u', ttlMs: 60_001 }, 'ttlMs'],
      [{ owner: 'u', waitMs: 30_001 }, 'waitMs'],
      [{ owner: 'u', waitMs: -1 }, 'waitMs'],
      [{ owner: 'u', waitMs: 1.5 }, 'waitMs'],
      [{ owner: 'u', filter: { attributes: { city: { nested: 1 } } } }, 'filter.attributes'],
      [{ owner: 'u', filter: { colour: 'red' } }, 'filter.colour'],
      [{ owner: 'u', filter: [] }, 'filter'],
      [{ owner: 'u', filter: [{ attributes: { city: 'bj' } }] }, 'filter'],
      [{ owner: 'u', surprise: true }, 'surprise'],
      // A lone surrogate (JSON's \ud800 escape) is not text Postgres or Redis' Lua JSON can take as sent.
      [{ owner: 'u', filter: { attributes: { city: '\ud800' } } }, 'filter.attributes.city'],
      [{ owner: 'u', filter: { attributes: { ['\udc00']: 'bj' } } }, 'filter.attributes'],
      [{ owner: 'u\ud800', filter: { valuePrefix: '\udfff' } }, 'filter.valuePrefix'],
      // NUL, which Postgres' text cannot hold: an owner holding one was taken, and its confirm failed.
      [{ owner: 'o\0x' }, 'owner'],
      [{ owner: 'u', filter: { valuePrefix: '1\0' } }, 'filter.valuePrefix'],
    ];
    for (const [body, field] of cases) {
      const answer = await reserve('strict', body);
      expect(answer.status, JSON.stringify(body)).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields.map((f: { field: string }) => f.field)).toContain(field);
    }
    const notJson = await api.request('POST', '/v1/pools/strict/reservations', '{"owner":', { 'content-type': 'application/json' });
    expect(notJson.status).toBe(400);
    expect(notJson.body.error.code).toBe('VALIDATION_FAILED');
    const badConfirm = await api.post('/v1/reservations/strict.not-a-uuid/confirm', { resourceIds: ['1'] });
    expect(badConfirm.status).toBe(400);
    const r = await reserve('strict', { owner: 'u' });
    for (const body of [{ resourceIds: [] }, { resourceIds: ['abc'] }, { resourceIds: ['1', '1'] }, {}]) {
      const answer = await api.post(`/v1/reservations/${r.body.id}/confirm`, body);
      expect(answer.status).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    }
    expect(await api.stats('strict')).toEqual({ total: 3, free: 2, held: 1, allocated: 0 });
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
  });

  it('unknown pools and reservations are 404 with their codes', async () => {
    const pool = await reserve('no-such-pool', { owner: 'u' });
    expect(pool.status).toBe(404);
    expect(pool.body.error.code).toBe('POOL_NOT_FOUND');
    const id = 'flow.3f1c2a9e-5b7d-4e8f-9a0b-1c2d3e4f5a6b';
    for (const answer of [
      await api.get(`/v1/reservations/${id}`),
      await api.post(`/v1/reservations/${id}/confirm`, { resourceIds: ['1'] }),
      await api.post(`/v1/reservations/${id}/extend`, { ttlMs: 5000 }),
      await api.del(`/v1/reservations/${id}`),
    ]) {
      expect(answer.status).toBe(404);
      expect(answer.body.error.code).toBe('RESERVATION_NOT_FOUND');
    }
  });
});

// Between a reservation's expiresAt and the sweep that closes it (HOLD_GRACE_MS later, for a confirm that came in time
// to reach Redis), the API calls it expired: its items must not count against its owner.
describe('counters of a reservation past its expiresAt, before the sweep closes it', () => {
  const world = new TestWorld('lapsed');
  let api: TestInstance;

  beforeAll(async () => {
    // A grace of 1 s: the sweep closes a reservation 1 s after its expiresAt.
    api = await world.start({ HOLD_GRACE_MS: '1000', SWEEP_INTERVAL_MS: '250' });
  });
  afterAll(() => world.cleanup());

  /** Waits until `expiresAt` has passed by 50 ms, and checks that the API calls the reservation expired then. */
  async function pastExpiry(path: string, expiresAt: string, extend: Record<string, unknown>): Promise<void> {
    await sleep(Math.max(0, Date.parse(expiresAt) - Date.now()) + 50);
    expect((await api.post(`${path}/${extend.call}`, extend.body)).body.error.code).toBe('HOLD_EXPIRED');
  }

  it("the owner's quota no longer counts it: a reserve is answered 201, not 429", async () => {
    await seedPool(api, 'lapsed-quota', numbers(4), { maxHoldsPerOwner: 2 });
    const first = await api.post('/v1/pools/lapsed-quota/reservations', { owner: 'o', count: 2, ttlMs: 1000 });
    expect(first.status).toBe(201);
    expect((await api.post('/v1/pools/lapsed-quota/reservations', { owner: 'o', count: 1 })).status).toBe(429);
    await pastExpiry(`/v1/reservations/${first.body.id}`, first.body.expiresAt, { call: 'extend', body: { ttlMs: 60_000 } });
    const again = await api.post('/v1/pools/lapsed-quota/reservations', { owner: 'o', count: 2 });
    expect(again.status, JSON.stringify(again.body)).toBe(201);
    // Counted once the sweep has closed the first: the owner holds 2, its quota.
    await sleep(1500);
    const over = await api.post('/v1/pools/lapsed-quota/reservations', { owner: 'o', count: 1 });
    expect(over.body.error).toMatchObject({ code: 'OWNER_QUOTA_EXCEEDED', details: { held: 2 } });
  });

  it("a reviewer's lapsed lease no longer steers its next pull to that lease's group", async () => {
    expect((await api.post('/v1/pools', { name: 'lapsed-groups', kind: 'task' })).status).toBe(201);
    const tasks = (group: string, values: string[]) => ({ items: values.map((value) => ({ value, groupKey: group })) });
    expect((await api.post('/v1/pools/lapsed-groups/resources', tasks('G', ['g-1', 'g-2']))).status).toBe(201);
    // A lease in G (short), then one in H (long) taken while G has nothing free.
    const inG = await api.post('/v1/pools/lapsed-groups/tasks/next', { reviewer: 'r', leaseMs: 1000 });
    expect(inG.body.groupKey).toBe('G');
    const other = await api.post('/v1/pools/lapsed-groups/tasks/next', { reviewer: 'someone', leaseMs: 60_000 });
    expect(other.body.groupKey).toBe('G');
    expect((await api.post('/v1/pools/lapsed-groups/resources', tasks('H', ['h-1', 'h-2', 'h-3']))).status).toBe(201);
    const inH = await api.post('/v1/pools/lapsed-groups/tasks/next', { reviewer: 'r', leaseMs: 60_000 });
    expect(inH.body.groupKey).toBe('H');
    // The other G task comes free again; r's G lease lapses.
    expect((await api.post(`/v1/tasks/${other.body.leaseId}/abandon`, {})).status).toBe(200);
    await pastExpiry(`/v1/tasks/${inG.body.leaseId}`, inG.body.expiresAt, { call: 'heartbeat', body: {} });
    // r leases in H alone now: its next task is from H, though G has a free one (and would come first were G counted).
    for (let i = 0; i < 2; i++) {
      const next = await api.post('/v1/pools/lapsed-groups/tasks/next', { reviewer: 'r', leaseMs: 60_000 });
      expect(next.body.groupKey).toBe('H');
    }
  });
});
