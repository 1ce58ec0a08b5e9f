import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { loadConfig } from '../../src/config/app-config.js';
import { REDIS, REDIS_TIMEOUT_MESSAGE, createRedis, withTimeout } from '../../src/redis/redis.client.js';
import { HttpAnswer, TestInstance, TestWorld, eventually, numbers, seedPool, sleep } from '../support/harness.js';
import { OwnRedis, REDIS_URL, TcpProxy } from '../support/services.js';
import { DEAD_CONNECTION_MS, HoldStore } from '../../src/redis/hold-store.repository.js';
import { DomainError } from '../../src/common/errors.js';
import { poolKeys } from '../../src/redis/keys.js';

/** Blocks this process's event loop, as a long GC pause or a starved cold start does. */
function stall(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

describe('Redis command timeouts (withTimeout)', () => {
  // The service's own client, as createRedis configures it.
  const config = loadConfig({ DATABASE_URL: 'postgres://unused', REDIS_URL, REDIS_TIMEOUT_MS: '200' });
  const redis = createRedis(config);
  beforeAll(() => redis.connect());
  afterAll(() => redis.quit());

  it('an answer that arrived while the process was stalled wins over the timer that expired meanwhile', async () => {
    const ping = withTimeout(redis.ping(), config.REDIS_TIMEOUT_MS);
    // The PING is written before immediates run; Redis answers within a millisecond, into the socket,
    // while this process is stalled for 1.5 timeouts. When it resumes, the expired timer runs first.
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        stall(300);
        resolve();
      }),
    );
    await expect(ping).resolves.toBe('PONG');
  });

  it('a command with no answer fails with the timeout error after the timeout, not before', async () => {
    // Its own connection: BLPOP on a list nobody fills holds the connection until Redis answers, after 2 s.
    const blocking = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
    try {
      await blocking.ping();
      const started = Date.now();
      const blocked = withTimeout(blocking.blpop(`rptest:timeout:${process.pid}:${Date.now()}`, 2), 150);
      await expect(blocked).rejects.toThrow(REDIS_TIMEOUT_MESSAGE);
      const waited = Date.now() - started;
      expect(waited).toBeGreaterThanOrEqual(145);
      expect(waited).toBeLessThan(1500);
    } finally {
      blocking.disconnect();
    }
  });

  it("a command's own error passes through unchanged", async () => {
    await expect(withTimeout(redis.call('NO-SUCH-COMMAND'), config.REDIS_TIMEOUT_MS)).rejects.toThrow(/unknown command/i);
  });
});

/** `request` sent while the Redis at `url` is busy for `ms` (a long script elsewhere, a stalled disk); its answer once Redis is free. */
async function whileBusy<T = HttpAnswer>(url: string, ms: number, request: () => Promise<T>): Promise<T> {
  const client = new Redis(url);
  const spin = `local t = redis.call('TIME'); local s = t[1] * 1000 + t[2] / 1000
    repeat local n = redis.call('TIME') until n[1] * 1000 + n[2] / 1000 - s > tonumber(ARGV[1])
    return 1`;
  try {
    await client.ping();
    const busy = client.eval(spin, 0, ms);
    await sleep(50);
    const answer = await request();
    await busy;
    return answer;
  } finally {
    client.disconnect();
  }
}

describe("a reserve, or a confirm's pin, that got no answer in time", () => {
  const world = new TestWorld('reservetimeout');
  let own: OwnRedis;
  let api: TestInstance;

  beforeAll(async () => {
    // A Redis of its own: these tests keep it busy.
    own = await OwnRedis.start();
    api = await world.start({ REDIS_URL: own.url, REDIS_TIMEOUT_MS: '200', RECONCILE_INTERVAL_MS: '0' });
  });
  afterAll(async () => {
    try {
      await world.cleanup();
    } finally {
      await own.stop();
    }
  });

  const whileRedisBusy = <T = HttpAnswer>(ms: number, request: () => Promise<T>) => whileBusy(own.url, ms, request);

  it('without an Idempotency-Key is answered 503, and holds nothing once Redis has run it', async () => {
    await seedPool(api, 'slow', numbers(1), { maxHoldsPerOwner: 1 });
    const r = await whileRedisBusy(700, () => api.post('/v1/pools/slow/reservations', { owner: 'buyer', count: 1, ttlMs: 600_000 }));
    expect(r.status).toBe(503);
    expect(r.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
    // The reserve ran in Redis after all, and the release sent after it too: the item is free, and the
    // owner's quota of 1 is not used up.
    const { value } = await eventually(async () => {
      const again = await api.post('/v1/pools/slow/reservations', { owner: 'buyer', count: 1 });
      return again.status === 201 && again;
    }, 2000);
    expect(value.body.items).toHaveLength(1);
  });

  it('with an Idempotency-Key is answered 503 and holds nothing either; its retry with the same key makes a new reservation', async () => {
    await seedPool(api, 'slow-keyed', numbers(2), { maxHoldsPerOwner: 1 });
    const body = { owner: 'buyer', count: 1, ttlMs: 600_000 };
    const headers = { 'idempotency-key': 'order-7' };
    const r = await whileRedisBusy(700, () => api.post('/v1/pools/slow-keyed/reservations', body, headers));
    expect(r.status).toBe(503);
    expect(r.body.error.message).toMatch(/nothing was changed/);
    // The reserve ran in Redis after all, and the release sent after it: nothing is held, though the caller
    // may never send the call again.
    await eventually(async () => (await api.stats('slow-keyed')).held === 0, 2000);
    expect(await api.stats('slow-keyed')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    // The key was forgotten with it: a retry is a new reservation (not a replay of a released one), within
    // the owner's quota of 1, and the retry's retry replays that.
    const retry = await api.post('/v1/pools/slow-keyed/reservations', body, headers);
    expect(retry.status).toBe(201);
    expect(retry.body.state).toBe('held');
    const again = await api.post('/v1/pools/slow-keyed/reservations', body, headers);
    expect(again.status).toBe(200);
    expect(again.body.id).toBe(retry.body.id);
    expect(await api.stats('slow-keyed')).toEqual({ total: 2, free: 1, held: 1, allocated: 0 });
  });

  it('a reserve whose answer is lost with its connection is answered 503 and undone once Redis takes the undo: nothing stays held', async () => {
    await seedPool(api, 'reply-lost', numbers(3), { maxHoldsPerOwner: 3 });
    const client = api.app.get<Redis>(REDIS) as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const reserve = client.rp_reserve;
    // The script runs in Redis; its answer is lost with the connection, and so is the first undo.
    const lost = vi.spyOn(client, 'rp_reserve').mockImplementationOnce(async function (this: unknown, ...args: unknown[]) {
      await reserve.apply(this, args);
      throw new Error('Connection is closed.');
    });
    const holds = api.app.get(HoldStore);
    let firstUndoAt = Infinity;
    const undoFails = vi.spyOn(holds, 'undoReserve').mockImplementationOnce(async () => {
      firstUndoAt = Date.now();
      throw DomainError.unavailable('redis', new Error('Connection is closed.'));
    });
    try {
      try {
        const r = await api.post('/v1/pools/reply-lost/reservations', { owner: 'buyer', count: 3 });
        const answeredAt = Date.now();
        expect(r.status).toBe(503);
        expect(lost).toHaveBeenCalled();
        // Tried before the answer (the sweeper's upkeep may have sent it again since, on a busy machine).
        expect(firstUndoAt).toBeLessThanOrEqual(answeredAt);
      } finally {
        lost.mockRestore();
      }
      // The sweeper's upkeep sends the undo again: the items are free, and the owner's quota is not used up.
      const { value } = await eventually(async () => {
        const again = await api.post('/v1/pools/reply-lost/reservations', { owner: 'buyer', count: 3 });
        return again.status === 201 && again;
      }, 3000);
      expect(value.body.items).toHaveLength(3);
      expect(undoFails.mock.calls.length).toBeGreaterThan(1);
    } finally {
      undoFails.mockRestore();
    }
  });

  it('a reserve that was never sent (no connection: ioredis refuses it at once) is answered 503 and needs no undo', async () => {
    await seedPool(api, 'never-sent', numbers(1));
    const client = api.app.get<Redis>(REDIS) as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const refused = vi
      .spyOn(client, 'rp_reserve')
      .mockRejectedValueOnce(new Error("Stream isn't writeable and enableOfflineQueue options is false"));
    const undo = vi.spyOn(api.app.get(HoldStore), 'undoReserve');
    try {
      expect((await api.post('/v1/pools/never-sent/reservations', { owner: 'buyer' })).status).toBe(503);
      expect(refused).toHaveBeenCalled();
      expect(undo).not.toHaveBeenCalled();
    } finally {
      refused.mockRestore();
      undo.mockRestore();
    }
  });

  it('a reserve that reaches Redis after its undo (the undo went first, on another connection) holds nothing', async () => {
    await seedPool(api, 'undone-first', numbers(2));
    const holds = api.app.get(HoldStore);
    const reservationId = 'undone-first.3f1c2a9e-5b7d-4e8f-9a0b-1c2d3e4f5a6b';
    await holds.undoReserve('undone-first', reservationId, undefined);
    const late = await holds.reserve('undone-first', {
      reservationId,
      owner: 'buyer',
      count: 1,
      ttlMs: 60_000,
      maxHoldsPerOwner: 0,
      kind: 'r',
      groupAffinity: false,
    });
    expect(late.status).toBe('exhausted');
    expect(await api.stats('undone-first')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('a keyed reserve and its retry with the same key, both answered 503, leave nothing held', async () => {
    await seedPool(api, 'twice', numbers(2), { maxHoldsPerOwner: 1 });
    const body = { owner: 'buyer', count: 1, ttlMs: 600_000 };
    const headers = { 'idempotency-key': 'order-42' };
    // Redis runs: the reserve (it makes the reservation), the retry (a replay of it), then both undos.
    const answers = await whileRedisBusy(800, async () => {
      const first = api.post('/v1/pools/twice/reservations', body, headers);
      await sleep(30); // the client's retry (its own timeout was shorter)
      const retry = api.post('/v1/pools/twice/reservations', body, headers);
      return Promise.all([first, retry]);
    });
    expect(answers.map((a) => a.status)).toEqual([503, 503]);
    await eventually(async () => (await api.stats('twice')).held === 0, 3000);
    expect(await api.stats('twice')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    expect((await api.post('/v1/pools/twice/reservations', body, headers)).status).toBe(201);
  });

  it('undoing a keyed reserve changes nothing once a retry with the key was answered with it (a replay)', async () => {
    // The order a retry through another instance can take: Redis, busy past both timeouts, runs that
    // instance's replay before the undo this one sent.
    await seedPool(api, 'keyed-replayed', numbers(2));
    const body = { owner: 'buyer', count: 1 };
    const headers = { 'idempotency-key': 'order-9' };
    const first = await api.post('/v1/pools/keyed-replayed/reservations', body, headers);
    expect(first.status).toBe(201);
    expect((await api.post('/v1/pools/keyed-replayed/reservations', body, headers)).status).toBe(200);
    await api.app.get(HoldStore).undoReserve('keyed-replayed', first.body.id, 'order-9');
    expect((await api.get(`/v1/reservations/${first.body.id}`)).body.state).toBe('held');
    expect(await api.stats('keyed-replayed')).toEqual({ total: 2, free: 1, held: 1, allocated: 0 });
    const again = await api.post('/v1/pools/keyed-replayed/reservations', body, headers);
    expect(again.status).toBe(200);
    expect(again.body.id).toBe(first.body.id);
    // Without a replay, the undo releases it and forgets the key.
    const other = await api.post('/v1/pools/keyed-replayed/reservations', body, { 'idempotency-key': 'order-10' });
    await api.app.get(HoldStore).undoReserve('keyed-replayed', other.body.id, 'order-10');
    expect((await api.get(`/v1/reservations/${other.body.id}`)).body.state).toBe('released');
    expect((await api.post('/v1/pools/keyed-replayed/reservations', body, { 'idempotency-key': 'order-10' })).status).toBe(201);
  });

  it('a client replaying one keyed reserve without end grows its record only so far, and the undos keep the reservation then', async () => {
    await seedPool(api, 'replayed-often', numbers(2));
    const body = { owner: 'buyer', count: 1 };
    const headers = { 'idempotency-key': 'order-loop' };
    const first = await api.post('/v1/pools/replayed-often/reservations', body, headers);
    expect(first.status).toBe(201);
    const record = poolKeys(world.prefix, 'replayed-often').reservation(first.body.id);
    const client = own.client();
    try {
      const requesters = async () => ((await client.hget(record, 'rq')) ?? '').split(' ').filter(Boolean);
      for (let i = 0; i < 31; i++) expect((await api.post('/v1/pools/replayed-often/reservations', body, headers)).status).toBe(200);
      expect(await requesters()).toHaveLength(32); // the maker and 31 replays, each of which an undo may take out
      for (let i = 0; i < 40; i++) expect((await api.post('/v1/pools/replayed-often/reservations', body, headers)).status).toBe(200);
      // Past 32 the list is no longer kept: no undo releases the reservation (one of those replays was answered).
      expect(await requesters()).toEqual(['*']);
      await api.app.get(HoldStore).undoReserve('replayed-often', first.body.id, 'order-loop');
      expect((await api.get(`/v1/reservations/${first.body.id}`)).body.state).toBe('held');
      expect(await requesters()).toEqual(['*']);
    } finally {
      client.disconnect();
    }
  });

  it("undoing a keyed reserve forgets the key only if it names that reservation: another call's key is kept", async () => {
    await seedPool(api, 'keyed-other', numbers(2));
    const body = { owner: 'buyer', count: 1 };
    const headers = { 'idempotency-key': 'order-8' };
    const first = await api.post('/v1/pools/keyed-other/reservations', body, headers);
    expect(first.status).toBe(201);
    // The same key again while Redis is busy: the reserve replays the first (it makes nothing new), times out,
    // and the release sent after it names another id, so it changes nothing and keeps the key.
    const r = await whileRedisBusy(700, () => api.post('/v1/pools/keyed-other/reservations', body, headers));
    expect(r.status).toBe(503);
    await sleep(300);
    const replay = await api.post('/v1/pools/keyed-other/reservations', body, headers);
    expect(replay.status).toBe(200);
    expect(replay.body).toMatchObject({ id: first.body.id, state: 'held' });
    expect(await api.stats('keyed-other')).toEqual({ total: 2, free: 1, held: 1, allocated: 0 });
  });

  // A confirm whose pin got no answer in time.

  /** A reservation of `count` items, made while Redis answers. */
  async function reserved(pool: string, count: number): Promise<{ id: string; items: { resourceId: string }[] }> {
    await seedPool(api, pool, numbers(count + 1));
    const r = await api.post(`/v1/pools/${pool}/reservations`, { owner: 'buyer', count, ttlMs: 600_000 });
    expect(r.status).toBe(201);
    return r.body;
  }

  it('is answered 503 and leaves the reservation held, not confirming: extend and release work at once', async () => {
    const r = await reserved('pin-undone', 3);
    const chosen = r.items[0].resourceId;
    const answer = await whileBusy(own.url, 700, () => api.post(`/v1/reservations/${r.id}/confirm`, { resourceIds: [chosen] }));
    expect(answer.status).toBe(503);
    expect(answer.body.error).toMatchObject({ code: 'DEPENDENCY_UNAVAILABLE', message: expect.stringMatching(/nothing was changed/) });
    // Redis ran the pin (twice: it was sent again after the first timeout) once it was free, then its undo: the
    // reservation is held, with no commit epoch, as before the confirm.
    const record = poolKeys(world.prefix, 'pin-undone').reservation(r.id);
    const client = new Redis(own.url);
    try {
      const fields = await client.hmget(record, 's', 'ep', 'eo', 'pn');
      expect(fields.slice(0, 3)).toEqual(['held', null, null]);
      expect(Number(fields[3])).toBeGreaterThanOrEqual(1); // the pin did run
    } finally {
      client.disconnect();
    }
    expect((await api.get(`/v1/reservations/${r.id}`)).body.state).toBe('held');
    const extended = await api.post(`/v1/reservations/${r.id}/extend`, { ttlMs: 60_000 });
    expect(extended.status).toBe(200);
    const released = await api.del(`/v1/reservations/${r.id}`);
    expect(released.status).toBe(200);
    expect(released.body.state).toBe('released');
    expect(await api.stats('pin-undone')).toEqual({ total: 4, free: 4, held: 0, allocated: 0 });
    expect(await world.query('SELECT id FROM t_resource WHERE state <> 1')).toEqual([]);
  });

  it('is answered 503, and its retry confirms', async () => {
    const r = await reserved('pin-retried', 3);
    const chosen = r.items[1].resourceId;
    const answer = await whileBusy(own.url, 700, () => api.post(`/v1/reservations/${r.id}/confirm`, { resourceIds: [chosen] }));
    expect(answer.status).toBe(503);
    const retry = await api.post(`/v1/reservations/${r.id}/confirm`, { resourceIds: [chosen] });
    expect(retry.status).toBe(200);
    expect(retry.body.allocated.map((a: { resourceId: string }) => a.resourceId)).toEqual([chosen]);
    expect(retry.body.released).toHaveLength(2);
    expect(await api.stats('pin-retried')).toEqual({ total: 4, free: 3, held: 0, allocated: 1 });
  });

  it("the undo leaves a pin that joined the epoch after it alone, and a pin whose token is another's", async () => {
    const r = await reserved('pin-joined', 2);
    const holds = api.app.get(HoldStore);
    const selection = [r.items[0].resourceId];
    const record = poolKeys(world.prefix, 'pin-joined').reservation(r.id);
    const client = new Redis(own.url);
    try {
      const first = await holds.pin('pin-joined', r.id, selection, 15_000);
      expect(first).toMatchObject({ status: 'pinned', opened: true });
      const token = (await client.hget(record, 'eo'))!;
      expect(await holds.undoPin('pin-joined', r.id, 'another-attempt')).toBe(false);
      // The same confirm again (the caller's retry) joins the epoch: it may be committing, so the first's undo
      // must leave the reservation confirming.
      const joined = await holds.pin('pin-joined', r.id, selection, 15_000);
      expect(joined).toMatchObject({ status: 'pinned', opened: false });
      expect(await holds.undoPin('pin-joined', r.id, token)).toBe(false);
      expect(await client.hget(record, 's')).toBe('confirming');
    } finally {
      client.disconnect();
    }
  });
});

describe('a connection to Redis left black-holed (a failover, a NAT that dropped it: no answer and no reset)', () => {
  const world = new TestWorld('blackhole');
  afterAll(() => world.cleanup());

  it('is made again once nothing has been answered on it for DEAD_CONNECTION_MS: reserves answer 503 until then, and 201 after (they answered 503 until the kernel gave it up, a quarter of an hour later)', async () => {
    const proxy = await TcpProxy.start(Number(new URL(REDIS_URL).port || 6379));
    try {
      const api = await world.start({ REDIS_URL: `redis://127.0.0.1:${proxy.port}`, REDIS_TIMEOUT_MS: '300' });
      await seedPool(api, 'holed', numbers(20));
      expect((await api.post('/v1/pools/holed/reservations', { owner: 'o' })).status).toBe(201);
      proxy.blackHole();
      const started = performance.now();
      const during = await api.post('/v1/pools/holed/reservations', { owner: 'o' });
      expect(during.status).toBe(503);
      let answer = during;
      while (answer.status !== 201 && performance.now() - started < DEAD_CONNECTION_MS + 8000) {
        await sleep(250);
        answer = await api.post('/v1/pools/holed/reservations', { owner: 'o' });
      }
      expect(answer.status).toBe(201);
      expect(performance.now() - started).toBeGreaterThan(DEAD_CONNECTION_MS - 1000);
    } finally {
      await proxy.cut();
    }
  }, 40_000);
});
