import { request as httpRequest } from 'node:http';
import { connect } from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { MAX_BODY_NODES } from '../../src/common/validation.js';
import { TestInstance, TestWorld, numbers, seedPool } from '../support/harness.js';

/**
 * Edges of API.md a client meets without looking for them: lengths counted in characters as Postgres counts
 * them, a bodiless call sent with a JSON Content-Type, a hold time above any pool's maximum on extend.
 */
describe('API.md edges', () => {
  const world = new TestWorld('edges');
  let api: TestInstance;

  beforeAll(async () => {
    api = await world.start();
  });
  afterAll(() => world.cleanup());

  it('an import whose value is longer than 256 characters (a character + U+FE0F, 2 characters each) is 400 VALIDATION_FAILED naming it, not 500, and inserts nothing', async () => {
    await seedPool(api, 'long-value', numbers(1));
    // 200 × ("a" + VARIATION SELECTOR-16) = 400 characters (code points) and 400 UTF-16 units: over the limit
    // by any count. class-validator's isLength counts each "a\uFE0F" as one, so validation lets it through
    // and Postgres' varchar(256) refuses it.
    const value = 'a\uFE0F'.repeat(200);
    const answer = await api.post('/v1/pools/long-value/resources', { items: [{ value: '13900000000' }, { value }] });
    expect(answer.status).toBe(400);
    expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    expect(answer.body.error.details.fields.map((f: { field: string }) => f.field)).toContain('items.1.value');
    expect((await world.query(`SELECT count(*)::int AS n FROM t_resource WHERE value = '13900000000'`))[0].n).toBe(0);
  });

  it('a reserve whose owner is longer than 128 characters (a character + U+FE0F, 2 characters each) is 400 VALIDATION_FAILED and holds nothing', async () => {
    await seedPool(api, 'long-owner', numbers(2));
    const owner = 'u\uFE0F'.repeat(100); // 200 characters
    const answer = await api.post('/v1/pools/long-owner/reservations', { owner });
    expect(answer.status).toBe(400);
    expect(answer.body.error.code).toBe('VALIDATION_FAILED');
    expect((await api.get('/v1/pools/long-owner')).body.stats).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('null for a field whose schema does not allow it is 400 VALIDATION_FAILED naming it and changes nothing; where it does, it means none', async () => {
    await seedPool(api, 'nulls', numbers(2), { kind: 'number' });
    await seedPool(api, 'null-tasks', numbers(1, '9000'), { kind: 'task' });
    const refused = async (
      answer: Promise<{ status: number; body: { error: { code: string; details: { fields: { field: string }[] } } } }>,
      field: string,
    ) => {
      const { status, body } = await answer;
      expect(status).toBe(400);
      expect(body.error.code).toBe('VALIDATION_FAILED');
      expect(body.error.details.fields.map((f) => f.field)).toEqual([field]);
    };
    for (const field of ['count', 'ttlMs', 'waitMs', 'filter']) {
      await refused(api.post('/v1/pools/nulls/reservations', { owner: 'o', [field]: null }), field);
    }
    await refused(api.post('/v1/pools/nulls/reservations', { owner: 'o', filter: { valuePrefix: null } }), 'filter.valuePrefix');
    await refused(api.post('/v1/pools/nulls/reservations', { owner: 'o', filter: { attributes: null } }), 'filter.attributes');
    expect((await api.get('/v1/pools/nulls')).body.stats).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    for (const field of ['holdTtlMs', 'maxHoldTtlMs'])
      await refused(api.post('/v1/pools', { name: `n-${field.toLowerCase()}`, kind: 'number', [field]: null }), field);
    expect((await api.get('/v1/pools/n-holdttlms')).status).toBe(404);
    await refused(api.post('/v1/pools/null-tasks/tasks/next', { reviewer: 'r', leaseMs: null }), 'leaseMs');
    const lease = (await api.post('/v1/pools/null-tasks/tasks/next', { reviewer: 'r' })).body;
    await refused(api.post(`/v1/tasks/${lease.leaseId}/heartbeat`, { leaseMs: null }), 'leaseMs');
    const reservation = (await api.post('/v1/pools/nulls/reservations', { owner: 'o' })).body;
    await refused(api.post(`/v1/reservations/${reservation.id}/extend`, { ttlMs: null }), 'ttlMs');
    // Where the schema says null: a pool without an owner limit, an item without attributes or group.
    const pool = await api.post('/v1/pools', { name: 'null-limit', kind: 'number', maxHoldsPerOwner: null });
    expect(pool.status).toBe(201);
    expect(pool.body.maxHoldsPerOwner).toBeNull();
    const imported = await api.post('/v1/pools/null-limit/resources', {
      items: [{ value: '13911110000', attributes: null, groupKey: null }],
    });
    expect(imported.status).toBe(201);
    const [row] = await world.query<{ attributes: unknown; group_key: string | null }>(
      `SELECT attributes, group_key FROM t_resource WHERE value = '13911110000'`,
    );
    expect(row).toEqual({ attributes: {}, group_key: null });
  });

  it('a request bad in its path and in its body is refused once, listing the bad fields of both (the path first), and changes nothing', async () => {
    await seedPool(api, 'both-bad', numbers(2));
    /** The fields an answer lists: the first, then all of them sorted. */
    const fieldsOf = async (
      answer: Promise<{ status: number; body: { error: { code: string; details: { fields: { field: string }[] } } } }>,
    ) => {
      const { status, body } = await answer;
      expect(status).toBe(400);
      expect(body.error.code).toBe('VALIDATION_FAILED');
      const fields = body.error.details.fields.map((f) => f.field);
      return [fields[0], fields.sort()];
    };
    expect(await fieldsOf(api.post('/v1/pools/BAD/reservations', { owner: '', count: 0 }))).toEqual(['pool', ['count', 'owner', 'pool']]);
    // No body at all: its required fields are missing.
    expect(await fieldsOf(api.request('POST', '/v1/pools/BAD/reservations'))).toEqual(['pool', ['owner', 'pool']]);
    // A body that is not an object (null included): the body itself.
    for (const body of ['null', '5', '"x"', 'true']) {
      expect(await fieldsOf(api.request('POST', '/v1/pools/BAD/reservations', body, { 'content-type': 'application/json' }))).toEqual([
        'pool',
        ['body', 'pool'],
      ]);
    }
    expect(await fieldsOf(api.request('POST', '/v1/pools/BAD/reservations', 'hello', { 'content-type': 'text/plain' }))).toEqual([
      'pool',
      ['body', 'pool'],
    ]);
    expect(await fieldsOf(api.post('/v1/reservations/not-an-id/extend', { ttlMs: 5 }))).toEqual(['id', ['id', 'ttlMs']]);
    expect(await fieldsOf(api.post('/v1/reservations/not-an-id/confirm', { resourceIds: [], bogus: 1 }))).toEqual([
      'id',
      ['bogus', 'id', 'resourceIds'],
    ]);
    expect(await fieldsOf(api.post('/v1/tasks/not-an-id/complete', { bogus: 1 }))).toEqual(['leaseId', ['bogus', 'leaseId']]);
    expect(await fieldsOf(api.request('DELETE', '/v1/reservations/not-an-id', 7))).toEqual(['id', ['body', 'id']]);
    // A body naming a great many unknown fields, on a route that takes none: a 400 (was a 500: the fields were added
    // to the path's refusal as the arguments of one call) listing the first 10,000 and counting the rest.
    const many = Object.fromEntries(Array.from({ length: 200_000 }, (_, i) => [`f${i}`, 1]));
    const answer = await api.request('DELETE', '/v1/reservations/not-an-id', many);
    expect(answer.status).toBe(400);
    expect(answer.body.error.details.fields).toHaveLength(10_000);
    expect(answer.body.error.details.fieldsOmitted).toBe(190_001);
    expect(answer.body.error.details.fields[0].field).toBe('id');
    expect(answer.body.error.details.fields[1].field).toBe('f0');
    // A bad Idempotency-Key of a reserve is listed with them, and alone when the path and the body are good.
    const badKey = { 'Idempotency-Key': 'has a space' };
    expect(await fieldsOf(api.post('/v1/pools/BAD/reservations', { owner: 5 }, badKey))).toEqual([
      'pool',
      ['Idempotency-Key', 'owner', 'pool'],
    ]);
    expect(await fieldsOf(api.post('/v1/pools/both-bad/reservations', { owner: 5 }, badKey))).toEqual([
      'Idempotency-Key',
      ['Idempotency-Key', 'owner'],
    ]);
    expect(await fieldsOf(api.post('/v1/pools/both-bad/reservations', { owner: 'o' }, badKey))).toEqual([
      'Idempotency-Key',
      ['Idempotency-Key'],
    ]);
    // (On another route the header means nothing.)
    expect((await api.post('/v1/reservations/not-an-id/extend', { ttlMs: 5000 }, badKey)).body.error.details.fields).toHaveLength(1);
    // One part bad: only its fields, as before.
    expect(await fieldsOf(api.post('/v1/pools/BAD/reservations', { owner: 'o' }))).toEqual(['pool', ['pool']]);
    expect(await fieldsOf(api.post('/v1/pools/both-bad/resources', { items: [{ value: '' }] }))).toEqual([
      'items.0.value',
      ['items.0.value'],
    ]);
    expect((await api.get('/v1/pools/both-bad')).body.stats).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  it('a body of more fields and array elements than any valid one (900,000 unknown fields in 8 MB ran the instance out of memory) is refused at once, naming the body, and changes nothing', async () => {
    await seedPool(api, 'wide', numbers(2));
    const reservation = await api.post('/v1/pools/wide/reservations', { owner: 'u', count: 1 });
    // Just over the most a valid body has (an import of 10,000 items of 32 attributes each).
    const fields = MAX_BODY_NODES + 1;
    const wide = `{"owner":"u"${Array.from({ length: fields }, (_, i) => `,"${i.toString(36)}":0`).join('')}}`;
    const long = `{"items":[${new Array(fields).fill('0').join(',')}]}`;
    const json = { 'content-type': 'application/json' };
    for (const [method, path, body] of [
      ['POST', '/v1/pools/wide/reservations', wide],
      ['POST', '/v1/pools/wide/resources', long],
      ['DELETE', `/v1/reservations/${reservation.body.id}`, wide],
    ] as const) {
      const answer = await api.request(method, path, body, json);
      expect(answer.status, `${method} ${path}`).toBe(400);
      expect(answer.body.error.details.fields, `${method} ${path}`).toEqual([
        { field: 'body', reason: `the body has more than ${MAX_BODY_NODES} fields and array elements in all` },
      ]);
    }
    // Under that, unknown fields by the hundred thousand: the first 10,000 listed, the rest counted, and nothing else
    // (the bad owner is not validated: that would take an error object for each unknown field too).
    const unknown = 360_000;
    const many = `{"owner":5${Array.from({ length: unknown }, (_, i) => `,"${i.toString(36)}":0`).join('')}}`;
    const answer = await api.request('POST', '/v1/pools/wide/reservations', many, json);
    expect(answer.status).toBe(400);
    expect(answer.body.error.details.fields).toHaveLength(10_000);
    expect(answer.body.error.details.fields[0]).toEqual({ field: '0', reason: 'property 0 should not exist' });
    expect(answer.body.error.details.fieldsOmitted).toBe(unknown - 10_000);
    expect(answer.body.error.details.fields.filter((f: { field: string }) => f.field === 'owner')).toEqual([]);
    expect(await api.stats('wide')).toEqual({ total: 2, free: 1, held: 1, allocated: 0 });
    expect((await api.get(`/v1/reservations/${reservation.body.id}`)).body.state).toBe('held');
  });

  it('a body nested thousands of levels deep is 400 VALIDATION_FAILED (was a 500: the copy recursed past the stack) and changes nothing', async () => {
    await seedPool(api, 'deep', numbers(2));
    const deep = (depth: number) => '['.repeat(depth) + ']'.repeat(depth);
    const bodies: [string, string][] = [
      ['/v1/pools/deep/reservations', `{"owner":"deep","filter":{"attributes":${deep(5000)}}}`],
      ['/v1/pools', `{"name":"deeper","kind":"number","x":${deep(5000)}}`],
      ['/v1/pools/deep/resources', `{"items":[{"value":"13900000001","attributes":${deep(5000)}}]}`],
    ];
    for (const [path, body] of bodies) {
      const answer = await api.post(path, body);
      expect(answer.status, path).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields).toEqual([{ field: 'body', reason: expect.stringMatching(/more than 32 levels deep/) }]);
    }
    // A filter as deep as the limit is judged on its fields, as before.
    const shallow = await api.post('/v1/pools/deep/reservations', `{"owner":"deep","filter":{"attributes":{"city":${deep(29)}}}}`);
    expect(shallow.status).toBe(400);
    expect(shallow.body.error.details.fields.map((f: { field: string }) => f.field)).toEqual(['filter.attributes']);
    expect(await api.stats('deep')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    expect((await api.get('/v1/pools/deeper')).status).toBe(404);
  });

  it('an unknown field named like a function every object has (toString, constructor, valueOf) is refused like any unknown field, at any level', async () => {
    await seedPool(api, 'proto-names', numbers(2));
    const reservation = await api.post('/v1/pools/proto-names/reservations', { owner: 'u', count: 1 });
    expect(reservation.status).toBe(201);
    const cases: [string, unknown, string[]][] = [
      ['/v1/pools', { name: 'q-tostring', kind: 'number', toString: 1 }, ['toString']],
      ['/v1/pools/proto-names/reservations', { owner: 'u', constructor: { x: 1 }, valueOf: 'y' }, ['constructor', 'valueOf']],
      ['/v1/pools/proto-names/reservations', { owner: 'u', filter: { hasOwnProperty: 1 } }, ['filter.hasOwnProperty']],
      [
        '/v1/pools/proto-names/resources',
        { items: [{ value: 'zz1', constructor: 1, isPrototypeOf: 2 }] },
        ['items.0.constructor', 'items.0.isPrototypeOf'],
      ],
      [`/v1/reservations/${reservation.body.id}/extend`, { ttlMs: 5000, valueOf: 'junk' }, ['valueOf']],
    ];
    for (const [path, body, fields] of cases) {
      const answer = await api.post(path, body);
      expect(answer.status, `${path} ${JSON.stringify(body)}`).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields.map((f: { field: string }) => f.field)).toEqual(fields);
    }
    // Inside attributes every key is data, as before.
    const imported = await api.post('/v1/pools/proto-names/resources', {
      items: [{ value: 'zz2', attributes: { constructor: 'c', toString: 't' } }],
    });
    expect(imported.body).toEqual({ inserted: 1, duplicates: 0 });
    expect(await api.stats('proto-names')).toEqual({ total: 3, free: 2, held: 1, allocated: 0 });
    expect((await api.get(`/v1/reservations/${reservation.body.id}`)).body.expiresAt).toBe(reservation.body.expiresAt);
    expect((await api.get('/v1/pools/q-tostring')).status).toBe(404);
    // Keys that could set a prototype are refused by the JSON parser, even as attribute keys, with a message that says so.
    for (const body of [
      '{"items":[{"value":"zz3","attributes":{"__proto__":"x"}}]}',
      '{"items":[{"value":"zz3","attributes":{"constructor":{"prototype":"x"}}}]}',
      '{"items":[{"value":"zz3"}]',
    ]) {
      const answer = await api.request('POST', '/v1/pools/proto-names/resources', body, { 'content-type': 'application/json' });
      expect(answer.status, body).toBe(400);
      expect(answer.body.error.details.fields, body).toEqual([
        { field: 'body', reason: expect.stringContaining('not valid JSON, or has a key named "__proto__"') },
      ]);
    }
    expect(await api.stats('proto-names')).toEqual({ total: 3, free: 2, held: 1, allocated: 0 });
  });

  it('DELETE /v1/reservations/{id} sent with Content-Type: application/json and no body releases it (200, state released), as without the header', async () => {
    await seedPool(api, 'del-ct', numbers(2));
    const r = await api.post('/v1/pools/del-ct/reservations', { owner: 'u', count: 2 });
    expect(r.status).toBe(201);
    const answer = await api.request('DELETE', `/v1/reservations/${r.body.id}`, undefined, { 'content-type': 'application/json' });
    expect(answer.status).toBe(200);
    expect(answer.body.state).toBe('released');
    expect((await api.get('/v1/pools/del-ct')).body.stats).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
  });

  /** A request whose body is sent as these bytes, as they are. */
  const rawPost = async (path: string, bytes: Buffer, contentType: string) => {
    const res = await fetch(`${api.url}${path}`, { method: 'POST', headers: { 'content-type': contentType }, body: new Uint8Array(bytes) });
    return {
      status: res.status,
      body: (await res.json()) as { error: { code: string; details: { fields: { field: string; reason: string }[] } } },
    };
  };

  it('a body that is not valid UTF-8 is 400 VALIDATION_FAILED naming the body and changes nothing (two values that differed only there were stored as one, the second counted a duplicate)', async () => {
    await seedPool(api, 'utf8-only', numbers(1));
    const body = Buffer.concat([
      Buffer.from('{"items":[{"value":"inv-'),
      Buffer.from([0xff]),
      Buffer.from('"},{"value":"inv-'),
      Buffer.from([0xfe]),
      Buffer.from('"}]}'),
    ]);
    for (const contentType of ['application/json', 'application/json; charset=utf-8']) {
      const answer = await rawPost('/v1/pools/utf8-only/resources', body, contentType);
      expect(answer.status).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields).toEqual([{ field: 'body', reason: 'the body is not valid UTF-8' }]);
    }
    expect(await api.stats('utf8-only')).toEqual({ total: 1, free: 1, held: 0, allocated: 0 });
    // The same values in UTF-8 are two items.
    const good = await rawPost(
      '/v1/pools/utf8-only/resources',
      Buffer.from('{"items":[{"value":"inv-\u00ff"},{"value":"inv-þ"}]}'),
      'application/json; charset=UTF-8',
    );
    expect(good.status).toBe(201);
    expect(good.body).toEqual({ inserted: 2, duplicates: 0 });
  });

  it('a JSON body declared in a charset other than UTF-8 is 400 VALIDATION_FAILED naming the body and holds nothing (it was read as UTF-8: "Jos\\xE9" and "Jos\\xE8" became one owner)', async () => {
    await seedPool(api, 'latin1', numbers(2));
    const body = Buffer.concat([Buffer.from('{"owner":"Jos'), Buffer.from([0xe9]), Buffer.from('"}')]);
    for (const contentType of [
      'application/json; charset=iso-8859-1',
      'application/json;charset="latin1"',
      'application/json; charset=utf-16',
    ]) {
      const answer = await rawPost('/v1/pools/latin1/reservations', body, contentType);
      expect(answer.status).toBe(400);
      expect(answer.body.error.code).toBe('VALIDATION_FAILED');
      expect(answer.body.error.details.fields).toEqual([{ field: 'body', reason: expect.stringContaining('must be JSON in UTF-8') }]);
    }
    expect(await api.stats('latin1')).toEqual({ total: 2, free: 2, held: 0, allocated: 0 });
    // US-ASCII is UTF-8's subset: taken when the body is ASCII.
    const ascii = await rawPost('/v1/pools/latin1/reservations', Buffer.from('{"owner":"Jose"}'), 'application/json; charset=us-ascii');
    expect(ascii.status).toBe(201);
  });

  it('a body of a type no parser takes, announced by its Content-Length, is refused at once without waiting for it (it waited for REQUEST_TIMEOUT_MS, then 408)', async () => {
    const url = new URL(api.url);
    const started = performance.now();
    const answer = await new Promise<string>((resolve, reject) => {
      let text = '';
      const socket = connect(Number(url.port), url.hostname, () =>
        socket.write(`POST /v1/pools HTTP/1.1\r\nHost: x\r\nContent-Type: application/xml\r\nContent-Length: 10\r\n\r\n`),
      );
      socket.on('data', (chunk) => {
        text += chunk.toString();
        if (text.includes('\r\n\r\n{')) socket.destroy();
      });
      socket.on('close', () => resolve(text));
      socket.on('error', reject);
    });
    expect(answer).toMatch(/^HTTP\/1\.1 400 /);
    expect(performance.now() - started).toBeLessThan(1000);
  });

  /** A request sent with `Transfer-Encoding: chunked` and the given chunks (none: an empty body). */
  const chunked = (method: string, path: string, chunks: string[], headers: Record<string, string> = {}) =>
    new Promise<{ status: number; body: { state?: string; error?: { code: string } } }>((resolve, reject) => {
      const req = httpRequest(`${api.url}${path}`, { method, headers: { 'transfer-encoding': 'chunked', ...headers } }, (res) => {
        let text = '';
        res.setEncoding('utf8').on('data', (d: string) => (text += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body: JSON.parse(text) }));
      });
      req.on('error', reject);
      for (const chunk of chunks) req.write(chunk);
      req.end();
    });

  it('a chunked request whose body is empty is one without a body, with or without a Content-Type (DELETE released nothing and answered 400); one with a body and no Content-Type is still refused', async () => {
    await seedPool(api, 'chunked-empty', numbers(4));
    const types: Record<string, string>[] = [{ 'content-type': 'application/json' }, {}, { 'content-type': 'text/plain' }];
    for (const headers of types) {
      const r = await api.post('/v1/pools/chunked-empty/reservations', { owner: 'u', count: 1 });
      expect(r.status).toBe(201);
      const answer = await chunked('DELETE', `/v1/reservations/${r.body.id}`, [], headers);
      expect(answer.status).toBe(200);
      expect(answer.body.state).toBe('released');
    }
    const r = await api.post('/v1/pools/chunked-empty/reservations', { owner: 'u', count: 1 });
    const refusedTypes: Record<string, string>[] = [
      {},
      { 'content-type': 'text/plain' },
      { 'content-type': 'application/x-www-form-urlencoded' },
    ];
    for (const headers of refusedTypes) {
      const refused = await chunked('DELETE', `/v1/reservations/${r.body.id}`, ['a=1'], headers);
      expect(refused.status).toBe(400);
      expect(refused.body.error?.code).toBe('VALIDATION_FAILED');
    }
    expect(await api.stats('chunked-empty')).toEqual({ total: 4, free: 3, held: 1, allocated: 0 });
    expect((await api.get(`/v1/reservations/${r.body.id}`)).body.state).toBe('held');
  });

  it('a path no route serves (or a method it does not take) is 404 ROUTE_NOT_FOUND whatever its body (a body that was not JSON made it 400)', async () => {
    for (const [method, path] of [
      ['POST', '/v1/nothing'],
      ['PUT', '/v1/pools'],
      ['POST', '/health/live'],
    ]) {
      for (const body of ['{', '{"a":1}', undefined]) {
        const answer = await api.request(method, path, body);
        expect(answer.status, `${method} ${path} ${body}`).toBe(404);
        expect(answer.body.error.code).toBe('ROUTE_NOT_FOUND');
      }
    }
  });

  it("extend with a ttlMs above 7 days is capped by the pool's maxHoldTtlMs (200), not refused", async () => {
    await seedPool(api, 'ext-cap', numbers(1), { maxHoldTtlMs: 7_200_000 });
    const r = await api.post('/v1/pools/ext-cap/reservations', { owner: 'u', ttlMs: 60_000 });
    expect(r.status).toBe(201);
    const before = Date.now();
    const answer = await api.post(`/v1/reservations/${r.body.id}/extend`, { ttlMs: 8 * 86_400_000 });
    expect(answer.status).toBe(200);
    const expiresIn = Date.parse(answer.body.expiresAt) - before;
    expect(expiresIn).toBeGreaterThan(7_200_000 - 5_000);
    expect(expiresIn).toBeLessThanOrEqual(7_200_000 + 5_000);
  });

  it("a heartbeat with a leaseMs above 7 days is capped by the pool's maxHoldTtlMs, and complete takes a JSON Content-Type with no body", async () => {
    await seedPool(api, 'hb-cap', ['task-1'], { kind: 'task', maxHoldTtlMs: 7_200_000 });
    const lease = await api.post('/v1/pools/hb-cap/tasks/next', { reviewer: 'r', leaseMs: 60_000 });
    expect(lease.status).toBe(200);
    const before = Date.now();
    const beat = await api.post(`/v1/tasks/${lease.body.leaseId}/heartbeat`, { leaseMs: 8 * 86_400_000 });
    expect(beat.status).toBe(200);
    expect(Date.parse(beat.body.expiresAt) - before).toBeGreaterThan(7_200_000 - 5_000);
    expect(Date.parse(beat.body.expiresAt) - before).toBeLessThanOrEqual(7_200_000 + 5_000);
    const done = await api.request('POST', `/v1/tasks/${lease.body.leaseId}/complete`, undefined, { 'content-type': 'application/json' });
    expect(done.status).toBe(200);
    expect(done.body.state).toBe('completed');
  });
});
