import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { TestInstance, TestWorld, numbers, seedPool } from '../support/harness.js';

// Invariants 1 and 2 under real concurrency: two app instances on one Postgres and one Redis.
describe('two instances, one Postgres, one Redis', () => {
  const world = new TestWorld('concurrency');
  let a: TestInstance;
  let b: TestInstance;

  beforeAll(async () => {
    a = await world.start();
    b = await world.start();
  });
  afterAll(() => world.cleanup());

  it('400 concurrent reserve(count 3) over a 60-item pool: exactly 20 reservations, no item twice, the rest POOL_EXHAUSTED', async () => {
    await seedPool(a, 'burst', numbers(60));
    const answers = await Promise.all(
      Array.from({ length: 400 }, (_, i) => (i % 2 ? a : b).post('/v1/pools/burst/reservations', { owner: `buyer-${i}`, count: 3 })),
    );
    const won = answers.filter((r) => r.status === 201);
    const lost = answers.filter((r) => r.status !== 201);
    expect(won).toHaveLength(20);
    expect(lost).toHaveLength(380);
    for (const r of lost) {
      expect(r.status).toBe(409);
      expect(r.body.error.code).toBe('POOL_EXHAUSTED');
    }
    const held = won.flatMap((r) => r.body.items.map((i: { resourceId: string }) => i.resourceId));
    expect(held).toHaveLength(60);
    expect(new Set(held).size).toBe(60);
    const pool = await a.get('/v1/pools/burst');
    expect(pool.body.stats).toEqual({ total: 60, free: 0, held: 60, allocated: 0 });
  });

  it('the same reservation confirmed on both instances at once: both 200 with the same body, one allocation, version +1 once', async () => {
    await seedPool(a, 'twice', numbers(3));
    const reserved = await a.post('/v1/pools/twice/reservations', { owner: 'payer', count: 3 });
    expect(reserved.status).toBe(201);
    const chosen = reserved.body.items[0];
    const body = { resourceIds: [chosen.resourceId] };
    const [x, y] = await Promise.all([
      a.post(`/v1/reservations/${reserved.body.id}/confirm`, body),
      b.post(`/v1/reservations/${reserved.body.id}/confirm`, body),
    ]);
    expect(x.status).toBe(200);
    expect(y.status).toBe(200);
    expect(y.body).toEqual(x.body);
    expect(x.body.allocated).toEqual([{ resourceId: chosen.resourceId, value: chosen.value, version: chosen.version + 1 }]);

    const history = await world.query(`SELECT action, version FROM t_allocation_history WHERE resource_id = $1`, [chosen.resourceId]);
    expect(history).toEqual([{ action: 'allocate', version: chosen.version + 1 }]);
    const [row] = await world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [chosen.resourceId]);
    expect(row).toEqual({ state: 2, version: chosen.version + 1, owner: 'payer' });
  });

  it('60 confirms at once share commit batches, and each lands or fails on its own: stale ones 409, the rest 200', async () => {
    await seedPool(a, 'batched', numbers(180));
    const reservations = await Promise.all(
      Array.from({ length: 60 }, (_, i) => a.post('/v1/pools/batched/reservations', { owner: `buyer-${i}`, count: 3 })),
    );
    const chosen = reservations.map((r) => r.body.items[0].resourceId as string);
    // Ten of the chosen items moved on in Postgres behind the holds' backs: their version checks must fail.
    const stale = chosen.filter((_, i) => i % 6 === 0);
    await world.query(`UPDATE t_resource SET version = version + 1 WHERE id = ANY($1::bigint[])`, [stale]);
    const repository = a.app.get(ResourceRepository) as unknown as { callAllocate: (batch: unknown[]) => Promise<unknown> };
    const batches = vi.spyOn(repository, 'callAllocate');
    const answers = await Promise.all(
      reservations.map((r, i) => a.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [chosen[i]] })),
    );
    const sizes = batches.mock.calls.map(([batch]) => batch.length);
    batches.mockRestore();
    expect(sizes.reduce((x, y) => x + y, 0)).toBe(60);
    expect(Math.max(...sizes)).toBeGreaterThan(1);
    answers.forEach((answer, i) => {
      if (stale.includes(chosen[i])) expect([answer.status, answer.body.error?.code]).toEqual([409, 'HOLD_LOST']);
      else expect(answer.status).toBe(200);
    });
    const [row] = await world.query(
      `SELECT count(*)::int AS n, count(DISTINCT reservation_id)::int AS reservations FROM t_allocation_history h
         JOIN t_pool p ON p.id = h.pool_id WHERE p.name = 'batched' AND h.action = 'allocate'`,
    );
    expect(row).toEqual({ n: 50, reservations: 50 });
    expect((await a.get('/v1/pools/batched')).body.stats).toMatchObject({ total: 180, allocated: 50 });
  });

  it('many buyers confirming and releasing concurrently never allocate an item twice', async () => {
    await seedPool(a, 'churn', numbers(30));
    const rounds = await Promise.all(
      Array.from({ length: 40 }, async (_, i) => {
        const api = i % 2 ? a : b;
        const r = await api.post('/v1/pools/churn/reservations', { owner: `u${i}`, count: 2 });
        if (r.status !== 201) return r.status;
        const pick = r.body.items[i % 2].resourceId;
        const c = await (i % 3 ? a : b).post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [pick] });
        if (c.status === 200 && i % 4 === 0) {
          await api.post(`/v1/pools/churn/resources/${pick}/release`, { owner: `u${i}` });
        }
        return c.status;
      }),
    );
    expect(rounds.filter((s) => s === 200).length).toBeGreaterThan(0);
    expect(rounds.every((s) => s === 200 || s === 409)).toBe(true);
    // Per item, history versions strictly increase and actions alternate allocate/release.
    const history = await world.query<{ resource_id: string; action: string; version: number }>(
      `SELECT h.resource_id::text, h.action, h.version FROM t_allocation_history h
         JOIN t_pool p ON p.id = h.pool_id WHERE p.name = 'churn' ORDER BY h.resource_id, h.id`,
    );
    const byItem = new Map<string, { action: string; version: number }[]>();
    for (const h of history) byItem.set(h.resource_id, [...(byItem.get(h.resource_id) ?? []), h]);
    for (const events of byItem.values()) {
      events.forEach((e, i) => {
        expect(e.action).toBe(i % 2 === 0 ? 'allocate' : 'release');
        if (i > 0) expect(e.version).toBeGreaterThan(events[i - 1].version);
      });
    }
  });
});
