import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { PoolRepository } from '../../src/database/pool.repository.js';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { DomainError } from '../../src/common/errors.js';
import { HoldStore } from '../../src/redis/hold-store.repository.js';
import { poolKeys } from '../../src/redis/keys.js';
import { TestInstance, TestWorld, eventually, numbers, seedPool, sleep, staleReadAt } from '../support/harness.js';

describe('pools and resources', () => {
  const world = new TestWorld('pools');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  const poolCount = async () => (await world.query(`SELECT count(*)::int AS n FROM t_pool`))[0].n;
  const resourceCount = async () => (await world.query(`SELECT count(*)::int AS n FROM t_resource`))[0].n;

  it("a pool whose Redis generation key is lost between its write and the pool's insert (a wipe then) gets it again", async () => {
    const pools = api.app.get(PoolRepository);
    const insert = pools.insert.bind(pools);
    const { Redis } = await import('ioredis');
    const client = new Redis(api.config.REDIS_URL);
    // As if Redis was wiped after the key was written, and rebuilt from a pool list read before the insert.
    const lost = vi.spyOn(pools, 'insert').mockImplementationOnce(async (row) => {
      await client.del(poolKeys(world.prefix, row.name).generation);
      return insert(row);
    });
    try {
      expect((await api.post('/v1/pools', { name: 'key-lost', kind: 'number' })).status).toBe(201);
      expect(lost).toHaveBeenCalled();
      const [{ gen }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
      expect(await client.get(poolKeys(world.prefix, 'key-lost').generation)).toBe(String(gen));
    } finally {
      lost.mockRestore();
      client.disconnect();
    }
    // Its items are indexed, and reserved.
    expect((await api.post('/v1/pools/key-lost/resources', { items: [{ value: '1' }] })).body.inserted).toBe(1);
    expect((await api.post('/v1/pools/key-lost/reservations', { owner: 'o' })).status).toBe(201);
  });

  it("a pool created again under its name is refused before Redis is touched: its missing generation stays the rebuild's to write", async () => {
    expect((await api.post('/v1/pools', { name: 'exists', kind: 'number' })).status).toBe(201);
    const { Redis } = await import('ioredis');
    const client = new Redis(api.config.REDIS_URL);
    const generation = poolKeys(world.prefix, 'exists').generation;
    try {
      // As while a rebuild after a wipe puts the pool's Idempotency-Keys back, before it writes the generation.
      await client.del(generation);
      const again = await api.post('/v1/pools', { name: 'exists', kind: 'number' });
      expect(again.status).toBe(409);
      expect(again.body.error.code).toBe('POOL_EXISTS');
      expect(await client.exists(generation)).toBe(0);
    } finally {
      const [{ gen }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
      await api.app.get(HoldStore).setGeneration('exists', gen, 'always');
      client.disconnect();
    }
  });

  it('two imports of the same new values at once (a retried slow import) both answer, between them inserting each once', async () => {
    expect((await api.post('/v1/pools', { name: 'twice', kind: 'number' })).status).toBe(201);
    const values = numbers(3000, '1390000');
    for (let round = 0; round < 3; round++) {
      const batch = values.slice(round * 1000, (round + 1) * 1000).map((value) => ({ value }));
      // In opposite orders: Postgres used to end one of them as a deadlock, answered 503.
      const answers = await Promise.all([
        api.post('/v1/pools/twice/resources', { items: batch }),
        api.post('/v1/pools/twice/resources', { items: [...batch].reverse() }),
      ]);
      expect(answers.map((a) => a.status)).toEqual([201, 201]);
      expect(answers[0].body.inserted + answers[1].body.inserted).toBe(1000);
      expect(answers[0].body.duplicates + answers[1].body.duplicates).toBe(1000);
    }
    expect((await api.get('/v1/pools/twice')).body.stats).toEqual({ total: 3000, free: 3000, held: 0, allocated: 0 });
  });

  it('an import or a release committed while Redis failed is indexed by the sweeper soon after, without a rebuild', async () => {
    // No periodic rebuild on this instance: only the upkeep can index them.
    const api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    const holds = api.app.get(HoldStore);
    const refuse = () => Promise.reject(DomainError.unavailable('redis', new Error('Command timed out')));
    expect((await api.post('/v1/pools', { name: 'later', kind: 'number' })).status).toBe(201);
    // The import commits; its Redis step fails.
    const importFails = vi.spyOn(holds, 'addFree').mockImplementationOnce(refuse);
    try {
      const imported = await api.post('/v1/pools/later/resources', { items: [{ value: '1' }] });
      expect(imported.status).toBe(201);
      expect(imported.body.inserted).toBe(1);
    } finally {
      importFails.mockRestore();
    }
    const { value: r } = await eventually(async () => {
      const answer = await api.post('/v1/pools/later/reservations', { owner: 'o' });
      return answer.status === 201 && answer;
    }, 2000);
    const id = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    // The release commits; its Redis step fails.
    const releaseFails = vi.spyOn(holds, 'addFree').mockImplementationOnce(refuse);
    try {
      expect((await api.post(`/v1/pools/later/resources/${id}/release`, { owner: 'o' })).status).toBe(200);
    } finally {
      releaseFails.mockRestore();
    }
    await eventually(async () => (await api.post('/v1/pools/later/reservations', { owner: 'p' })).status === 201, 2000);
  });

  it('an import or a release answered 503 whose Postgres write committed all the same (its answer lost) is indexed soon after, with no retry', async () => {
    // No periodic rebuild on this instance: only the upkeep can index them.
    const api = await world.start({ RECONCILE_INTERVAL_MS: '0' });
    const resources = api.app.get(ResourceRepository);
    const lost = () => DomainError.unavailable('postgres', new Error('Connection terminated unexpectedly'));
    expect((await api.post('/v1/pools', { name: 'answer-lost', kind: 'number' })).status).toBe(201);
    const insertMany = resources.insertMany.bind(resources);
    const importLost = vi.spyOn(resources, 'insertMany').mockImplementationOnce(async (...args) => {
      await insertMany(...args);
      throw lost();
    });
    try {
      const imported = await api.post('/v1/pools/answer-lost/resources', { items: [{ value: '1' }, { value: '2' }] });
      expect(imported.status).toBe(503);
    } finally {
      importLost.mockRestore();
    }
    // The caller believed the 503 and never sent it again.
    const { value: r } = await eventually(async () => {
      const answer = await api.post('/v1/pools/answer-lost/reservations', { owner: 'o', count: 2 });
      return answer.status === 201 && answer;
    }, 3000);
    const id = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    const release = resources.release.bind(resources);
    const releaseLost = vi.spyOn(resources, 'release').mockImplementationOnce(async (...args) => {
      await release(...args);
      throw lost();
    });
    try {
      expect((await api.post(`/v1/pools/answer-lost/resources/${id}/release`, { owner: 'o' })).status).toBe(503);
    } finally {
      releaseLost.mockRestore();
    }
    const { value: again } = await eventually(async () => {
      const answer = await api.post('/v1/pools/answer-lost/reservations', { owner: 'p', count: 2 });
      return answer.status === 201 && answer;
    }, 3000);
    expect(again.body.items.map((i: { resourceId: string }) => i.resourceId)).toContain(id);
  });

  it('a retried import or release whose first attempt committed unseen (its answer or its Redis step lost) indexes what it finds free', async () => {
    expect((await api.post('/v1/pools', { name: 'unseen', kind: 'number' })).status).toBe(201);
    const [{ id: poolId }] = await world.query(`SELECT id FROM t_pool WHERE name = 'unseen'`);
    // An import that committed in Postgres and never reached Redis.
    await world.query(`INSERT INTO t_resource (pool_id, value) VALUES ($1, 'a'), ($1, 'b')`, [poolId]);
    expect((await api.post('/v1/pools/unseen/reservations', { owner: 'o' })).status).toBe(409);
    const again = await api.post('/v1/pools/unseen/resources', { items: [{ value: 'a' }, { value: 'b' }, { value: 'c' }] });
    expect(again.body).toEqual({ inserted: 1, duplicates: 2 });
    const r = await api.post('/v1/pools/unseen/reservations', { owner: 'o', count: 3 });
    expect(r.status).toBe(201);
    const id = r.body.items[0].resourceId;
    expect((await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] })).status).toBe(200);
    // A release that committed in Postgres and never reached Redis: the caller's retry is refused, as API.md says,
    // and the item is reservable at once.
    await world.query(`UPDATE t_resource SET state = 1, owner = NULL, version = version + 1 WHERE id = $1`, [id]);
    const retried = await api.post(`/v1/pools/unseen/resources/${id}/release`, { owner: 'o' });
    expect(retried.body.error.code).toBe('NOT_ALLOCATED');
    const next = await api.post('/v1/pools/unseen/reservations', { owner: 'p', count: 3 });
    expect(next.status).toBe(201);
    expect(next.body.items.map((i: { resourceId: string }) => i.resourceId)).toContain(id);
  });

  it('creates a pool with the documented defaults and refuses a taken name', async () => {
    const created = await api.post('/v1/pools', { name: 'phone-bj', kind: 'number' });
    expect(created.status).toBe(201);
    expect(created.body).toMatchObject({
      name: 'phone-bj',
      kind: 'number',
      holdTtlMs: 600_000,
      maxHoldTtlMs: 3_600_000,
      maxHoldsPerOwner: null,
    });
    expect(Date.parse(created.body.createdAt)).toBeGreaterThan(Date.now() - 60_000);
    const full = await api.post('/v1/pools', {
      name: 'phone-sh',
      kind: 'number',
      holdTtlMs: 900_000,
      maxHoldTtlMs: 3_600_000,
      maxHoldsPerOwner: 10,
    });
    expect(full.body).toMatchObject({ holdTtlMs: 900_000, maxHoldsPerOwner: 10 });
    const taken = await api.post('/v1/pools', { name: 'phone-bj', kind: 'task' });
    expect(taken.status).toBe(409);
    expect(taken.body.error.code).toBe('POOL_EXISTS');
    const list = await api.get('/v1/pools');
    expect(list.body.map((p: { name: string }) => p.name)).toEqual(expect.arrayContaining(['phone-bj', 'phone-sh']));
    const one = await api.get('/v1/pools/phone-bj');
    expect(one.body).toMatchObject({ name: 'phone-bj', stats: { total: 0, free: 0, held: 0, allocated: 0 } });
  });

  it('refuses bad pools with 400 and creates nothing', async () => {
    const before = await poolCount();
    for (const body of [
      { name: 'Bad Name', kind: 'number' },
      { name: '-dash', kind: 'number' },
      { name: 'x'.repeat(64), kind: 'number' },
      { name: 'ok', kind: 'car' },
      { name: 'ok' },
      { name: 'ok', kind: 'number', holdTtlMs: 500 },
      { name: 'ok', kind: 'number', holdTtlMs: 10_000, maxHoldTtlMs: 5000 },
      // maxHoldTtlMs defaults to 3,600,000 (API.md), whatever holdTtlMs is.
      { name: 'ok', kind: 'number', holdTtlMs: 5_000_000 },
      { name: 'ok', kind: 'number', maxHoldsPerOwner: 0 },
      { name: 'ok', kind: 'number', colour: 'red' },
    ]) {
      const answer = await api.post('/v1/pools', body);
      expect(answer.status, JSON.stringify(body)).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields.length).toBeGreaterThan(0);
    }
    expect(await poolCount()).toBe(before);
    // A hold time out of line with the other's default names the field that was sent.
    for (const [body, field, reason] of [
      [
        { holdTtlMs: 5_000_000 },
        'holdTtlMs',
        'holdTtlMs must not be greater than maxHoldTtlMs (3600000, its default; send a maxHoldTtlMs of at least 5000000)',
      ],
      [
        { maxHoldTtlMs: 5000 },
        'maxHoldTtlMs',
        'maxHoldTtlMs must not be less than holdTtlMs (600000, its default; send a holdTtlMs of at most 5000)',
      ],
      [{ holdTtlMs: 10_000, maxHoldTtlMs: 5000 }, 'holdTtlMs', 'holdTtlMs must not be greater than maxHoldTtlMs (5000)'],
    ] as const) {
      const answer = await api.post('/v1/pools', { name: 'ttl', kind: 'number', ...body });
      expect(answer.body.error.details.fields, JSON.stringify(body)).toEqual([{ field, reason }]);
    }
    const missing = await api.get('/v1/pools/nope');
    expect(missing.status).toBe(404);
    expect(missing.body.error.code).toBe('POOL_NOT_FOUND');
    expect((await api.get('/v1/pools/NOT_VALID')).status).toBe(400);
  });

  it('imports items, counts duplicates and leaves them unchanged; new items are free at once', async () => {
    await api.post('/v1/pools', { name: 'import', kind: 'number' });
    const first = await api.post('/v1/pools/import/resources', {
      items: [{ value: '13800138000', attributes: { city: 'bj' }, groupKey: 'g1' }, { value: '13800138001' }, { value: '13800138001' }],
    });
    expect(first.status).toBe(201);
    expect(first.body).toEqual({ inserted: 2, duplicates: 1 });
    const second = await api.post('/v1/pools/import/resources', {
      items: [{ value: '13800138000', attributes: { city: 'sh' } }, { value: '13800138002' }],
    });
    expect(second.body).toEqual({ inserted: 1, duplicates: 1 });
    // A value already there between new ones, in the order the rows are written: the new ones before and after it
    // are inserted once.
    const third = await api.post('/v1/pools/import/resources', {
      items: [{ value: '13800138003' }, { value: '13800138001', groupKey: 'g2' }, { value: '13800137999' }],
    });
    expect(third.body).toEqual({ inserted: 2, duplicates: 1 });
    const [row] = await world.query(`SELECT attributes FROM t_resource WHERE value = '13800138000'`);
    expect(row.attributes).toEqual({ city: 'bj' });
    const rows = `SELECT value, group_key FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'import' ORDER BY value`;
    expect(await world.query(rows)).toEqual([
      { value: '13800137999', group_key: null },
      { value: '13800138000', group_key: 'g1' },
      { value: '13800138001', group_key: null },
      { value: '13800138002', group_key: null },
      { value: '13800138003', group_key: null },
    ]);
    expect((await api.get('/v1/pools/import')).body.stats).toEqual({ total: 5, free: 5, held: 0, allocated: 0 });
    const r = await api.post('/v1/pools/import/reservations', { owner: 'u', count: 5 });
    expect(r.status).toBe(201);
    // Reservable with what the first import gave it, not the second.
    expect(r.body.items.find((i: { value: string }) => i.value === '13800138000')).toMatchObject({
      version: 0,
      attributes: { city: 'bj' },
    });
  });

  it('refuses bad imports with 400 and inserts nothing', async () => {
    await api.post('/v1/pools', { name: 'import-bad', kind: 'number' });
    const before = await resourceCount();
    for (const body of [
      { items: [] },
      { items: [{ value: '' }] },
      { items: [{ value: 'x'.repeat(257) }] },
      { items: [{ value: 'ok' }, { value: 'y', attributes: { nested: { a: 1 } } }] },
      { items: [{ value: 'y', attributes: { n: 5 } }] },
      { items: [{ value: 'y', extra: 1 }] },
      { items: Array.from({ length: 10_001 }, (_, i) => ({ value: `v${i}` })) },
      { items: 'nope' },
      { items: [[{ value: 'a' }]] },
      { items: [[]] },
      // Lone surrogates (JSON's \ud800-style escapes outside a pair), in a value, a group and an attribute.
      { items: [{ value: 'ok' }, { value: 'a\ud800' }] },
      { items: [{ value: 'g', groupKey: '\udc00' }] },
      { items: [{ value: 'y', attributes: { city: '\udbff' } }] },
      // NUL, which Postgres' text cannot hold.
      { items: [{ value: 'a\0b' }] },
      { items: [{ value: 'g', groupKey: 'x\0' }] },
    ]) {
      const answer = await api.post('/v1/pools/import-bad/resources', body);
      expect(answer.status).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    }
    expect(await resourceCount()).toBe(before);
    const missing = await api.post('/v1/pools/no-pool/resources', { items: [{ value: 'a' }] });
    expect(missing.status).toBe(404);
    expect(missing.body.error.code).toBe('POOL_NOT_FOUND');
  });

  it('reads a resource as free, held and allocated; unknown ids are 404 RESOURCE_NOT_FOUND', async () => {
    await seedPool(api, 'states', numbers(1));
    const [{ id }] = await world.query(`SELECT r.id::text FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = 'states'`);
    expect((await api.get(`/v1/pools/states/resources/${id}`)).body).toMatchObject({
      id,
      pool: 'states',
      state: 'free',
      version: 0,
      owner: null,
      groupKey: null,
      attributes: {},
    });
    const r = await api.post('/v1/pools/states/reservations', { owner: 'u' });
    expect((await api.get(`/v1/pools/states/resources/${id}`)).body.state).toBe('held');
    await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] });
    expect((await api.get(`/v1/pools/states/resources/${id}`)).body).toMatchObject({ state: 'allocated', owner: 'u', version: 1 });
    const missing = await api.get('/v1/pools/states/resources/999999999');
    expect(missing.status).toBe(404);
    expect(missing.body.error.code).toBe('RESOURCE_NOT_FOUND');
    expect((await api.get('/v1/pools/states/resources/abc')).status).toBe(400);
    expect((await api.get('/v1/pools/states/resources/9223372036854775807')).status).toBe(404);
    const tooBig = await api.get('/v1/pools/states/resources/9223372036854775808');
    expect(tooBig.status).toBe(400);
    expect(tooBig.body.error.code).toBe('VALIDATION_FAILED');
  });

  it('releases an allocated item: version +1, free and reservable at once; NOT_ALLOCATED otherwise', async () => {
    await seedPool(api, 'give-back', numbers(1));
    const r = await api.post('/v1/pools/give-back/reservations', { owner: 'owner-1' });
    const id = r.body.items[0].resourceId;
    await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] });
    const wrongOwner = await api.post(`/v1/pools/give-back/resources/${id}/release`, { owner: 'owner-2' });
    expect(wrongOwner.status).toBe(409);
    expect(wrongOwner.body.error.code).toBe('NOT_ALLOCATED');
    const released = await api.post(`/v1/pools/give-back/resources/${id}/release`, { owner: 'owner-1' });
    expect(released.status).toBe(200);
    expect(released.body).toMatchObject({ id, state: 'free', version: 2, owner: null });
    const again = await api.post(`/v1/pools/give-back/resources/${id}/release`, { owner: 'owner-1' });
    expect(again.status).toBe(409);
    expect(again.body.error.code).toBe('NOT_ALLOCATED');
    const next = await api.post('/v1/pools/give-back/reservations', { owner: 'owner-3' });
    expect(next.status).toBe(201);
    expect(next.body.items[0]).toMatchObject({ resourceId: id, version: 2 });
    const history = await world.query(`SELECT action, owner, version FROM t_allocation_history WHERE resource_id = $1 ORDER BY id`, [id]);
    expect(history).toEqual([
      { action: 'allocate', owner: 'owner-1', version: 1 },
      { action: 'release', owner: 'owner-1', version: 2 },
    ]);
    expect((await api.post(`/v1/pools/give-back/resources/${id}/release`, {})).status).toBe(400);
    expect((await api.post('/v1/pools/give-back/resources/99999999/release', { owner: 'x' })).body.error.code).toBe('RESOURCE_NOT_FOUND');
  });

  it('an import or a release that reaches Redis too long after its Postgres write (a stall) reads the rows again: free at once', async () => {
    const holds = api.app.get(HoldStore);
    const addFree = holds.addFree.bind(holds);
    // The first write of each call arrives as if this instance had stalled past READ_MAX_AGE_MS after the read.
    let calls = 0;
    const late = vi.spyOn(holds, 'addFree').mockImplementation(async (pool, generation, readAt, items) => {
      if (pool !== 'stalled-import') return addFree(pool, generation, readAt, items);
      calls++;
      return addFree(pool, generation, calls % 2 === 1 ? staleReadAt(readAt) : readAt, items);
    });
    try {
      await seedPool(api, 'stalled-import', numbers(3));
      expect(calls).toBe(2);
      expect((await api.get('/v1/pools/stalled-import')).body.stats).toMatchObject({ free: 3 });
      const r = await api.post('/v1/pools/stalled-import/reservations', { owner: 'o', count: 1 });
      const id = r.body.items[0].resourceId;
      await api.post(`/v1/reservations/${r.body.id}/confirm`, { resourceIds: [id] });
      expect((await api.post(`/v1/pools/stalled-import/resources/${id}/release`, { owner: 'o' })).status).toBe(200);
      expect(calls).toBe(4);
      expect((await api.get('/v1/pools/stalled-import')).body.stats).toMatchObject({ free: 3, allocated: 0 });
    } finally {
      late.mockRestore();
    }
  });

  it('a body over the limit is 413 PAYLOAD_TOO_LARGE and inserts nothing', async () => {
    const small = await world.start({ BODY_LIMIT_BYTES: '2048' });
    await small.post('/v1/pools', { name: 'small-body', kind: 'number' });
    const before = await resourceCount();
    const answer = await small.post('/v1/pools/small-body/resources', { items: numbers(200).map((value) => ({ value })) });
    expect(answer.status).toBe(413);
    expect(answer.body.error.code).toBe('PAYLOAD_TOO_LARGE');
    expect(await resourceCount()).toBe(before);
  });

  it('too many requests from one client are 429 RATE_LIMITED', async () => {
    const limited = await world.start({ RATE_LIMIT_PER_SECOND: '1', RATE_LIMIT_BURST: '3' });
    const answers = [];
    for (let i = 0; i < 5; i++) answers.push(await limited.get('/v1/pools'));
    expect(answers.slice(0, 3).map((a) => a.status)).toEqual([200, 200, 200]);
    expect(answers[3].status).toBe(429);
    expect(answers[3].body.error.code).toBe('RATE_LIMITED');
    expect(answers[3].headers.get('retry-after')).toBe('1');
    expect((await limited.get('/health/live')).status).toBe(200);
    await sleep(1100);
    expect((await limited.get('/v1/pools')).status).toBe(200);
  });

  it('behind a proxy TRUST_PROXY names, the rate limit counts by the client address X-Forwarded-For gives; without it, by the connection (the proxy)', async () => {
    const forwarded = (instance: TestInstance, client: string) =>
      instance.request('GET', '/v1/pools', undefined, { 'x-forwarded-for': client });
    const trusting = await world.start({ RATE_LIMIT_PER_SECOND: '1', RATE_LIMIT_BURST: '2', TRUST_PROXY: 'loopback' });
    onTestFinished(() => trusting.close());
    const clients = ['203.0.113.1', '203.0.113.2', '203.0.113.3'];
    const each = [];
    for (const client of clients) for (let i = 0; i < 2; i++) each.push((await forwarded(trusting, client)).status);
    expect(each).toEqual([200, 200, 200, 200, 200, 200]);
    expect((await forwarded(trusting, clients[0])).status).toBe(429);
    const direct = await world.start({ RATE_LIMIT_PER_SECOND: '1', RATE_LIMIT_BURST: '2' });
    onTestFinished(() => direct.close());
    const shared = [];
    for (const client of clients) shared.push((await forwarded(direct, client)).status);
    expect(shared).toEqual([200, 200, 429]);
  });

  it('requests refused before they reach a route (no API key, a wrong one, the wrong role, a query string) count toward the rate limit too', async () => {
    const admin = 'admin-key-0123456789';
    const limited = await world.start({ RATE_LIMIT_PER_SECOND: '1', RATE_LIMIT_BURST: '4', API_KEYS: `admin:${admin}` });
    onTestFinished(() => limited.close());
    const answers = [
      await limited.get('/v1/pools'),
      await limited.request('GET', '/v1/pools', undefined, { authorization: 'Bearer guess-1' }),
      await limited.request('GET', '/v1/pools?x=1', undefined, { authorization: `Bearer ${admin}` }),
      await limited.request('GET', '/v1/pools', undefined, { authorization: 'Bearer guess-2' }),
      await limited.request('GET', '/v1/pools', undefined, { authorization: 'Bearer guess-3' }),
      await limited.request('GET', '/v1/pools', undefined, { authorization: `Bearer ${admin}` }),
    ];
    expect(answers.map((a) => a.status)).toEqual([401, 401, 400, 401, 429, 429]);
    expect(answers[4].body.error).toEqual({
      code: 'RATE_LIMITED',
      message: 'too many requests; slow down',
      details: { limitPerSecond: 1 },
    });
    expect(answers[4].headers.get('retry-after')).toBe('1');
    expect(answers[4].headers.get('x-request-id')).toBeTruthy();
    expect((await limited.get('/health/live')).status).toBe(200);
  });
});
