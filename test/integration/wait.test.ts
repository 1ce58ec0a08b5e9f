import type { Redis } from 'ioredis';
import { connect } from 'node:net';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { HoldStore, ReserveResult } from '../../src/redis/hold-store.repository.js';
import { poolBase } from '../../src/redis/keys.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';

type Item = { resourceId: string };
const ids = (items: Item[]) => items.map((i) => i.resourceId).sort();

/** waitMs: a reserve that finds too few free items waits for them, up to waitMs (API.md: 409 "after waitMs"). */
describe('reserve with waitMs', () => {
  const world = new TestWorld('wait');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  const reserve = (pool: string, body: Record<string, unknown>, headers?: Record<string, string>) =>
    api.post(`/v1/pools/${pool}/reservations`, body, headers);
  /** A reserve of 2 for "gone" that waits up to 10 s, sent with `signal`: the error's name once it is aborted. */
  const waitingCaller = (pool: string, signal: AbortSignal) =>
    fetch(`${api.url}/v1/pools/${pool}/reservations`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ owner: 'gone', count: 2, waitMs: 10_000 }),
      signal,
    }).catch((err: Error) => err.name);
  const timed = async <T>(run: () => Promise<T>) => {
    const started = Date.now();
    const value = await run();
    return { value, ms: Date.now() - started };
  };

  it('gets items released while it waits, all or nothing, and holds each once', async () => {
    await seedPool(api, 'freed', numbers(3));
    const first = await reserve('freed', { owner: 'a', count: 3 });
    expect(first.status).toBe(201);
    // Two waiters for 2 items each: when the 3 come back, one of them gets 2, the other goes on waiting and
    // gets nothing (one item is not enough for it).
    const waiters = [
      timed(() => reserve('freed', { owner: 'b', count: 2, waitMs: 1_500 })),
      timed(() => reserve('freed', { owner: 'c', count: 2, waitMs: 1_500 })),
    ];
    await sleep(300);
    expect((await api.del(`/v1/reservations/${first.body.id}`)).status).toBe(200);
    const answers = await Promise.all(waiters);
    const won = answers.filter((a) => a.value.status === 201);
    const lost = answers.filter((a) => a.value.status !== 201);
    expect(won).toHaveLength(1);
    expect(won[0].value.body.items).toHaveLength(2);
    expect(won[0].ms).toBeGreaterThanOrEqual(290);
    expect(lost[0].value.status).toBe(409);
    expect(lost[0].value.body.error.code).toBe('POOL_EXHAUSTED');
    expect(lost[0].ms).toBeGreaterThanOrEqual(1_490);
    expect(await api.stats('freed')).toEqual({ total: 3, free: 1, held: 2, allocated: 0 });
    const rest = await reserve('freed', { owner: 'd', count: 1 });
    expect(rest.status).toBe(201);
    expect(ids([...won[0].value.body.items, ...rest.body.items])).toEqual(ids(first.body.items));
  });

  it('gets items that come back at expiry, swept while it waits', async () => {
    await seedPool(api, 'expiring', numbers(2));
    const first = await reserve('expiring', { owner: 'a', count: 2, ttlMs: 1_000 });
    const waiting = await timed(() => reserve('expiring', { owner: 'b', count: 2, waitMs: 5_000 }));
    expect(waiting.value.status).toBe(201);
    expect(ids(waiting.value.body.items)).toEqual(ids(first.body.items));
    expect(waiting.ms).toBeGreaterThanOrEqual(900);
    // A hold starts when the items are held, not when the wait began.
    const ttl = Date.parse(waiting.value.body.expiresAt) - Date.now();
    expect(ttl).toBeGreaterThan(590_000);
  });

  it('answers 409 POOL_EXHAUSTED once waitMs has passed, holding nothing; waitMs 0 answers at once', async () => {
    await seedPool(api, 'empty', numbers(1));
    const held = await reserve('empty', { owner: 'a', count: 1 });
    expect(held.status).toBe(201);
    const waited = await timed(() => reserve('empty', { owner: 'b', count: 1, waitMs: 600 }));
    expect(waited.value.status).toBe(409);
    expect(waited.value.body.error.code).toBe('POOL_EXHAUSTED');
    expect(waited.ms).toBeGreaterThanOrEqual(590);
    expect(waited.ms).toBeLessThan(2_000);
    const atOnce = await timed(() => reserve('empty', { owner: 'b', count: 1, waitMs: 0 }));
    expect(atOnce.value.status).toBe(409);
    expect(atOnce.ms).toBeLessThan(300);
    expect(await api.stats('empty')).toEqual({ total: 1, free: 0, held: 1, allocated: 0 });
    // Asking for more than the pool has: waits, then 409.
    await api.del(`/v1/reservations/${held.body.id}`);
    const tooMany = await timed(() => reserve('empty', { owner: 'b', count: 2, waitMs: 300 }));
    expect(tooMany.value.status).toBe(409);
    expect(tooMany.ms).toBeGreaterThanOrEqual(290);
    expect(await api.stats('empty')).toEqual({ total: 1, free: 1, held: 0, allocated: 0 });
  });

  it('the owner quota and an Idempotency-Key replay answer at once, without waiting', async () => {
    await seedPool(api, 'quota', numbers(3), { maxHoldsPerOwner: 1 });
    const first = await reserve('quota', { owner: 'a', count: 1 }, { 'idempotency-key': 'k1' });
    expect(first.status).toBe(201);
    const overQuota = await timed(() => reserve('quota', { owner: 'a', count: 1, waitMs: 5_000 }));
    expect(overQuota.value.status).toBe(429);
    expect(overQuota.value.body.error.code).toBe('OWNER_QUOTA_EXCEEDED');
    expect(overQuota.ms).toBeLessThan(1_000);
    const replay = await timed(() => reserve('quota', { owner: 'a', count: 1 }, { 'idempotency-key': 'k1' }));
    expect(replay.value.status).toBe(200);
    expect(replay.value.body.id).toBe(first.body.id);
  });

  it('with an Idempotency-Key, two sends that wait make one reservation: the later one replays it', async () => {
    await seedPool(api, 'keyed', numbers(2));
    const blocker = await reserve('keyed', { owner: 'a', count: 2 });
    const body = { owner: 'b', count: 1, waitMs: 3_000 };
    const sends = [reserve('keyed', body, { 'idempotency-key': 'same' }), reserve('keyed', body, { 'idempotency-key': 'same' })];
    await sleep(200);
    await api.del(`/v1/reservations/${blocker.body.id}`);
    const [one, two] = await Promise.all(sends);
    expect([one.status, two.status].sort()).toEqual([200, 201]);
    expect(one.body.id).toBe(two.body.id);
    expect(await api.stats('keyed')).toEqual({ total: 2, free: 1, held: 1, allocated: 0 });
  });

  it('a caller that hangs up stops waiting: items freed afterwards are not held for it', async () => {
    await seedPool(api, 'hangup', numbers(2));
    const blocker = await reserve('hangup', { owner: 'a', count: 2 });
    const abort = new AbortController();
    const gone = waitingCaller('hangup', abort.signal);
    await sleep(200);
    abort.abort();
    expect(await gone).toBe('AbortError');
    await sleep(300);
    await api.del(`/v1/reservations/${blocker.body.id}`);
    // The waiter would have tried again within 250 ms.
    await sleep(600);
    expect(await api.stats('hangup')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('waiting reserves pipelined on one connection share one watch of it: no leak warning past 10, and all stop waiting when it closes', async () => {
    await seedPool(api, 'piped', numbers(1));
    const blocker = await reserve('piped', { owner: 'a' });
    const warnings: Error[] = [];
    const onWarning = (warning: Error) => warnings.push(warning);
    process.on('warning', onWarning);
    const url = new URL(api.url);
    const socket = connect(Number(url.port), url.hostname);
    try {
      await new Promise((resolve) => socket.once('connect', resolve));
      const body = JSON.stringify({ owner: 'w', waitMs: 5000 });
      const request = `POST /v1/pools/piped/reservations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`;
      socket.write(request.repeat(15));
      await sleep(500);
      socket.destroy();
      await sleep(300);
      expect(warnings.map((w) => w.name)).not.toContain('MaxListenersExceededWarning');
    } finally {
      process.off('warning', onWarning);
      socket.destroy();
    }
    // None waits on: the item freed now stays free.
    await api.del(`/v1/reservations/${blocker.body.id}`);
    await sleep(600);
    expect(await api.stats('piped')).toEqual({ total: 1, free: 1, held: 0, allocated: 0 });
  });

  it('a caller that hangs up while a try is holding its items gets nothing held: they are given back', async () => {
    await seedPool(api, 'left', numbers(2));
    const blocker = await reserve('left', { owner: 'a', count: 2 });
    const holds = api.app.get(HoldStore);
    const real = holds.reserve.bind(holds);
    const abort = new AbortController();
    let hit = false;
    let settle!: (result: ReserveResult) => void;
    const tried = new Promise<ReserveResult>((resolve) => (settle = resolve));
    // The try after the items came back holds them, and its caller hangs up while it runs.
    const spy = vi.spyOn(holds, 'reserve').mockImplementation(async (pool, req) => {
      const result = await real(pool, req);
      if (req.owner === 'gone' && result.status === 'ok' && !hit) {
        hit = true;
        abort.abort();
        await sleep(200);
        settle(result);
      }
      return result;
    });
    try {
      const gone = waitingCaller('left', abort.signal);
      await sleep(200);
      expect((await api.del(`/v1/reservations/${blocker.body.id}`)).status).toBe(200);
      expect(await gone).toBe('AbortError');
    } finally {
      spy.mockRestore();
    }
    const never = sleep(5_000).then(() => Promise.reject(new Error('no try was made after the items came back')));
    expect((await Promise.race([tried, never])).status).toBe('ok');
    await sleep(300);
    expect(await api.stats('left')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('a shutdown answers waiting reserves 503 at once, holding nothing', async () => {
    const other = await world.start();
    await seedPool(other, 'closing', numbers(1));
    await other.post('/v1/pools/closing/reservations', { owner: 'a', count: 1 });
    const waiting = timed(() => other.post('/v1/pools/closing/reservations', { owner: 'b', count: 1, waitMs: 20_000 }));
    await sleep(300);
    const closed = timed(() => other.close());
    const answer = await waiting;
    expect(answer.value.status).toBe(503);
    expect(answer.value.body.error).toMatchObject({ code: 'DEPENDENCY_UNAVAILABLE', details: { dependency: 'instance' } });
    expect(answer.ms).toBeLessThan(5_000);
    expect((await closed).ms).toBeLessThan(5_000);
    expect(await api.stats('closing')).toEqual({ total: 1, free: 0, held: 1, allocated: 0 });
    // It left its waiting line (reserve.lua, `line`) as it answered.
    expect(await api.app.get<Redis>(REDIS).exists(`${poolBase(world.prefix, 'closing')}wq:-`)).toBe(0);
  });

  it('past MAX_WAITING_RESERVES waiting on an instance, one more is 429 RATE_LIMITED at once; waitMs 0 still answers', async () => {
    const narrow = await world.start({ MAX_WAITING_RESERVES: '1' });
    await seedPool(narrow, 'crowded', numbers(1));
    await narrow.post('/v1/pools/crowded/reservations', { owner: 'a', count: 1 });
    const waiting = narrow.post('/v1/pools/crowded/reservations', { owner: 'b', count: 1, waitMs: 1_000 });
    await sleep(100);
    const refused = await timed(() => narrow.post('/v1/pools/crowded/reservations', { owner: 'c', count: 1, waitMs: 1_000 }));
    expect(refused.value.status).toBe(429);
    expect(refused.value.body.error).toMatchObject({ code: 'RATE_LIMITED', details: { waitingReserves: 1 } });
    expect(refused.ms).toBeLessThan(500);
    expect((await narrow.post('/v1/pools/crowded/reservations', { owner: 'c', count: 1 })).status).toBe(409);
    expect((await narrow.get('/metrics')).body).toMatch(/^respool_waiting_reserves 1$/m);
    expect((await waiting).status).toBe(409);
    expect((await narrow.get('/metrics')).body).toMatch(/^respool_waiting_reserves 0$/m);
    // Its wait over, the next may wait.
    const after = await timed(() => narrow.post('/v1/pools/crowded/reservations', { owner: 'c', count: 1, waitMs: 300 }));
    expect(after.value.status).toBe(409);
    expect(after.ms).toBeGreaterThanOrEqual(290);
  });
});
