import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { DomainError } from '../../src/common/errors.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { REDIS } from '../../src/redis/redis.client.js';
import { freeMember, poolKeys } from '../../src/redis/keys.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, stalledConfirm } from '../support/harness.js';

/**
 * The mechanisms behind DESIGN.md's invariants, one at a time, where the broader tests could miss a break:
 * each of these was written for a change to the code (a mutation) that broke an invariant and left every
 * other test green, or green by chance.
 */
describe('invariant mechanisms, each guarded', () => {
  const world = new TestWorld('guards');
  let api: TestInstance;
  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  it('invariant 1: a free-index entry for an item under a live hold is never handed out (the hold is taken only if there is none)', async () => {
    await seedPool(api, 'g1', numbers(1));
    const r = await api.post('/v1/pools/g1/reservations', { owner: 'a', count: 1 });
    const x = r.body.items[0];
    const redis = api.app.get<Redis>(REDIS);
    const keys = poolKeys(world.prefix, 'g1');
    await redis.zadd(keys.free, 0, freeMember(x.value, x.resourceId));
    const b = await api.post('/v1/pools/g1/reservations', { owner: 'b', count: 1 });
    expect(b.body.error?.code).toBe('POOL_EXHAUSTED');
    expect(await api.app.get(HoldStore).holder('g1', x.resourceId)).toBe(r.body.id);
    expect(await redis.zcard(keys.free)).toBe(0);
  });

  it('invariants 1 and 3: a late confirm does not release another item of its reservation that someone else holds now', async () => {
    await seedPool(api, 'p3', numbers(2));
    const r = await api.post('/v1/pools/p3/reservations', { owner: 'tardy', count: 2, ttlMs: 1000 });
    const [x, y] = r.body.items;
    await eventually(async () => (await api.stats('p3')).free === 2, 4000);
    const rival = await api.post('/v1/pools/p3/reservations', {
      owner: 'rival',
      count: 1,
      ttlMs: 60_000,
      filter: { valuePrefix: y.value },
    });
    expect(rival.body.items[0].resourceId).toBe(y.resourceId);
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [x.resourceId] })).status).toBe(200);
    expect(await api.app.get(HoldStore).holder('p3', y.resourceId)).toBe(rival.body.id);
    expect((await api.post('/v1/pools/p3/reservations', { owner: 'third', count: 1 })).body.error?.code).toBe('POOL_EXHAUSTED');
    expect((await api.post(`/v1/reservations/${rival.body.id}/confirm`, { resourceIds: [y.resourceId] })).status).toBe(200);
  });

  it('invariant 3: an extended reservation is not swept at its original expiry', async () => {
    await seedPool(api, 'p9', numbers(1), { holdTtlMs: 1000, maxHoldTtlMs: 60_000 });
    const r = await api.post('/v1/pools/p9/reservations', { owner: 'slow', count: 1 });
    expect((await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 10_000 })).status).toBe(200);
    await sleep(1000 + api.config.HOLD_GRACE_MS + 600);
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
    expect((await api.post('/v1/pools/p9/reservations', { owner: 'rival', count: 1 })).body.error?.code).toBe('POOL_EXHAUSTED');
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] })).status).toBe(200);
  });

  it('invariants 2 and 4: a reservation un-pinned after a commit that landed unseen is confirmed at expiry; the allocated item never returns', async () => {
    await seedPool(api, 'p11', numbers(2));
    const r = await api.post('/v1/pools/p11/reservations', { owner: 'buyer', count: 2, ttlMs: 1000 });
    const [chosen, other] = r.body.items.map((i: { resourceId: string }) => i.resourceId);
    const confirm = await stalledConfirm(api, 'p11', r.body.id, chosen, 200);
    expect(await confirm.land()).toBe('committed');
    // The caller saw a Postgres timeout: un-pinned, held again until expiry.
    expect(await api.app.get(HoldStore).unpin('p11', confirm.pinned)).toBe(true);
    await sleep(1000 + api.config.HOLD_GRACE_MS + 1000);
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('confirmed');
    expect((await api.post('/v1/pools/p11/reservations', { owner: 'next', count: 2 })).body.error?.code).toBe('POOL_EXHAUSTED');
    const one = await api.post('/v1/pools/p11/reservations', { owner: 'next', count: 1 });
    expect(one.body.items[0].resourceId).toBe(other);
  });

  // The next two inject the failure at the repository, to reach one exact step; recovery.test.ts cuts the real
  // connections (a proxy, a stopped redis-server) for the same answers.
  it('invariant 6: a confirm answered 503 (its Postgres call refused, injected) leaves the reservation held: it can be released at once', async () => {
    await seedPool(api, 'p19', numbers(2));
    const r = await api.post('/v1/pools/p19/reservations', { owner: 'payer', count: 2 });
    const down = vi
      .spyOn(api.app.get(ResourceRepository), 'allocate')
      .mockRejectedValue(DomainError.unavailable('postgres', new Error('connection refused')));
    try {
      const c = await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [r.body.items[0].resourceId] });
      expect(c.status).toBe(503);
    } finally {
      down.mockRestore();
    }
    expect((await api.app.get(HoldStore).read('p19', r.body.id))?.state).toBe('held');
    const released = await api.del(`/v1/reservations/${r.body.id}`);
    expect(released.status, JSON.stringify(released.body)).toBe(200);
    expect(await api.stats('p19')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('invariant 6: releasing an allocated item while Redis refuses (injected) is 503 and changes nothing', async () => {
    await seedPool(api, 'p20', numbers(1));
    const r = await api.post('/v1/pools/p20/reservations', { owner: 'o', count: 1 });
    const id = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    const holds = api.app.get(HoldStore);
    const refuse = () => Promise.reject(DomainError.unavailable('redis', new Error('connect ECONNREFUSED')));
    const clock = vi.spyOn(holds, 'clock').mockImplementation(refuse);
    const add = vi.spyOn(holds, 'addFree').mockImplementation(refuse);
    try {
      const rel = await api.post(`/v1/pools/p20/resources/${id}/release`, { owner: 'o' });
      expect([rel.status, rel.body.error?.code]).toEqual([503, 'DEPENDENCY_UNAVAILABLE']);
    } finally {
      clock.mockRestore();
      add.mockRestore();
    }
    expect(await world.query(`SELECT state, owner FROM t_resource WHERE id = $1`, [id])).toEqual([{ state: 2, owner: 'o' }]);
  });

  it('invariant 6: extend refuses a ttl below 1000 ms, or not an integer, with 400 and changes nothing', async () => {
    await seedPool(api, 'p21', numbers(1));
    const r = await api.post('/v1/pools/p21/reservations', { owner: 'o', count: 1 });
    for (const body of [{ ttlMs: 999 }, { ttlMs: 0 }, { ttlMs: -5 }, { ttlMs: 1.5 }, {}, { ttlMs: '5000' }, { ttlMs: 5000, x: 1 }]) {
      const answer = await api.post(`/v1/reservations/${r.body.id}/extend`, body);
      expect(answer.status, JSON.stringify(body)).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    }
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.expiresAt).toBe(r.body.expiresAt);
  });

  it('invariant 6: heartbeat refuses a leaseMs below 1000 ms, or not an integer, with 400 and changes nothing', async () => {
    await seedPool(api, 'p22', ['task-1'], { kind: 'task' });
    const lease = await api.post('/v1/pools/p22/tasks/next', { reviewer: 'r-1', leaseMs: 60_000 });
    const before = (await api.app.get(HoldStore).read('p22', lease.body.leaseId))?.expiresMs;
    expect(before).toBe(Date.parse(lease.body.expiresAt));
    for (const body of [{ leaseMs: 999 }, { leaseMs: 0 }, { leaseMs: -5000 }, { leaseMs: 1.5 }, { leaseMs: '5000' }, { leaseMs: 5000, x: 1 }]) {
      const answer = await api.post(`/v1/tasks/${lease.body.leaseId}/heartbeat`, body);
      expect(answer.status, JSON.stringify(body)).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    }
    expect((await api.app.get(HoldStore).read('p22', lease.body.leaseId))?.expiresMs).toBe(before);
  });
});
