/**
 * Baseline servers for the bench, each a bare Fastify process:
 *   ceiling  POST /reserve: the single EVALSHA of respool's reserve script (count 3), nothing else
 *            (plus respool's sweep script on a timer, so the pool keeps flowing as it does in respool);
 *   minimal  DESIGN.md's mechanism at its barest, as a floor. POST /reserve: SPOP 3 items from a set, a hold
 *            key each, the reservation and its expiry entry (a sweep returns expired ones); POST
 *            /reserve/:id/confirm: check and pin the holds, then the version-checked UPDATE and a history row
 *            per item, group-committed, then drop the holds and return the unchosen items; DELETE
 *            /reserve/:id. No value prefix or attribute search, quotas, idempotency, commit record, commit
 *            epochs or generation check, no validation, no recovery of a commit cut short;
 *   floor    POST /reserve: a fixed JSON answer of a reservation's size, no Redis: what the machine gives a
 *            request that does nothing;
 *   classic  POST /allocate: DESIGN.md's classic design: pick a random free row, then the version-checked
 *            UPDATE, retry on conflict.
 * Usage: node ceiling.js <ceiling|floor|classic> <port> <redisUrl|databaseUrl> <prefix|poolId> [maxId] [minId]
 *        node ceiling.js minimal <port> <redisUrl> <prefix> <databaseUrl>
 */
import Fastify from 'fastify';
import { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { AppConfig } from '../src/config/app-config.js';
import { loadScript } from '../src/redis/lua-prelude.js';
import { Batcher } from '../src/database/batcher.js';
import { MAX_BATCHES_IN_FLIGHT, MAX_COMMITS_PER_BATCH } from '../src/database/commit-batches.js';
import { MAX_BATCHES_PER_TICK, SWEEP_BATCH, SWEEP_WORK_BUDGET } from '../src/sweeper/sweep-limits.js';

const [mode, portArg, url, arg, maxIdArg] = process.argv.slice(2);
const app = Fastify({ logger: false });

/** respool's defaults: both Redis servers here sweep every SWEEP_INTERVAL_MS; the ceiling's holds also get HOLD_GRACE_MS. */
const defaults = new AppConfig();

/** respool's sweeper, as respool runs it: batches while more may be due, every SWEEP_INTERVAL_MS. */
function sweepLikeRespool(sweepBatch: () => Promise<boolean>): void {
  const tick = async () => {
    for (let i = 0; i < MAX_BATCHES_PER_TICK; i++) if (!(await sweepBatch())) break;
  };
  setInterval(() => void tick().catch(() => undefined), defaults.SWEEP_INTERVAL_MS).unref();
}

if (mode === 'ceiling') {
  const scripts = new URL('../../src/redis/scripts/', import.meta.url);
  const redis = new Redis(url);
  redis.defineCommand('rp_reserve', { numberOfKeys: 1, lua: loadScript(scripts, 'reserve') });
  redis.defineCommand('rp_sweep', { numberOfKeys: 1, lua: loadScript(scripts, 'sweep') });
  const base = `${arg}{ceiling}:`;
  const call = redis as unknown as Record<string, (...args: unknown[]) => Promise<string[]>>;
  sweepLikeRespool(async () => Number((await call.rp_sweep(`${base}free`, base, SWEEP_BATCH, 60_000, 15_000, SWEEP_WORK_BUDGET, 500))[2]) === 1);
  app.post('/reserve', async (_req, reply) => {
    const r = await call.rp_reserve(
      `${base}free`,
      base,
      `ceiling.${randomUUID()}`,
      'bench',
      3,
      1000,
      0,
      'r',
      60_000,
      '',
      '',
      0,
      '',
      '',
      '0',
      defaults.HOLD_GRACE_MS,
      // No waiting line (it waits for nothing), as respool's reserve without waitMs.
      '',
      0,
    );
    if (r[0] !== 'ok') return reply.status(409).send({ error: { code: 'POOL_EXHAUSTED' } });
    return reply.status(201).send({ id: r[1], items: JSON.parse(r[7]), expiresAt: new Date(Number(r[6])).toISOString() });
  });
} else if (mode === 'minimal') {
  const redis = new Redis(url, { enableAutoPipelining: true });
  const base = `${arg}{minimal}:`;
  // Free items are members "<id>:<version>" of one set.
  // minimal_reserve ARGV: base, rid, ttlMs. Returns {rid, "id:v,id:v,id:v", expiresMs} or {} when the pool is dry.
  redis.defineCommand('minimal_reserve', {
    numberOfKeys: 0,
    lua: `local base, rid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local members = redis.call('SPOP', base .. 'free', 3)
if #members < 3 then
  if #members > 0 then redis.call('SADD', base .. 'free', unpack(members)) end
  return {}
end
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for _, m in ipairs(members) do redis.call('SET', base .. 'h:' .. string.match(m, '^[^:]+'), rid, 'PX', ttl) end
local items = table.concat(members, ',')
redis.call('HSET', base .. 'r:' .. rid, 'i', items, 's', 'held')
redis.call('PEXPIRE', base .. 'r:' .. rid, ttl + 60000)
redis.call('ZADD', base .. 'exp', expires, rid)
return { rid, items, tostring(expires) }`,
  });
  // Returns a held reservation's items to the free set (all, or all but the allocated ones) and ends it.
  // minimal_end ARGV: base, rid, the state it must be in ("held" | "confirming"), the new state ("released" |
  // "confirmed"), ",allocated ids,". Returns 0, changing nothing, when the reservation is in another state.
  const endReservation = `local function end_reservation(base, rid, state, allocated)
  local items = redis.call('HGET', base .. 'r:' .. rid, 'i')
  if not items then return 0 end
  for m in string.gmatch(items, '[^,]+') do
    local id = string.match(m, '^[^:]+')
    if redis.call('GET', base .. 'h:' .. id) == rid then redis.call('DEL', base .. 'h:' .. id) end
    if not string.find(allocated, ',' .. id .. ',', 1, true) then redis.call('SADD', base .. 'free', m) end
  end
  redis.call('HSET', base .. 'r:' .. rid, 's', state)
  redis.call('ZREM', base .. 'exp', rid)
  return 1
end
`;
  redis.defineCommand('minimal_end', {
    numberOfKeys: 0,
    lua: `${endReservation}
if redis.call('HGET', ARGV[1] .. 'r:' .. ARGV[2], 's') ~= ARGV[3] then return 0 end
return end_reservation(ARGV[1], ARGV[2], ARGV[4], ARGV[5])`,
  });
  // minimal_pin ARGV: base, rid. The holds must still be this reservation's; returns {"pinned", items} or {"lost"}.
  redis.defineCommand('minimal_pin', {
    numberOfKeys: 0,
    lua: `local base, rid = ARGV[1], ARGV[2]
local f = redis.call('HMGET', base .. 'r:' .. rid, 's', 'i')
if f[1] ~= 'held' then return { 'lost' } end
for m in string.gmatch(f[2], '[^,]+') do
  if redis.call('GET', base .. 'h:' .. string.match(m, '^[^:]+')) ~= rid then return { 'lost' } end
end
redis.call('HSET', base .. 'r:' .. rid, 's', 'confirming')
return { 'pinned', f[2] }`,
  });
  // minimal_sweep ARGV: base, batch. Returns the number of reservations expired.
  redis.defineCommand('minimal_sweep', {
    numberOfKeys: 0,
    lua: `${endReservation}
local base, batch = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', base .. 'exp', '-inf', now, 'LIMIT', 0, batch)
for _, rid in ipairs(due) do
  if redis.call('HGET', base .. 'r:' .. rid, 's') == 'held' then end_reservation(base, rid, 'expired', ',')
  else redis.call('ZREM', base .. 'exp', rid) end
end
return #due`,
  });
  const call = redis as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  sweepLikeRespool(async () => Number(await call.minimal_sweep(base, SWEEP_BATCH)) === SWEEP_BATCH);
  // Group commit with respool's Batcher and its limits: the commits that arrive while batches are in
  // flight share one statement, the version-checked UPDATE of every item and its history row, in one
  // transaction. A commit lands if all of its items did.
  const db = new pg.Pool({ connectionString: maxIdArg, max: 16 });
  type Commit = { rid: string; ids: string[]; versions: number[] };
  const commits = new Batcher<Commit, boolean>(
    async (batch) => {
      const res = await db.query<{ landed: string }>({
        name: 'minimal_allocate',
        text: `WITH u AS (SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[]) AS x (id, v, rid)),
               allocated AS (UPDATE t_resource r SET state = 2, version = r.version + 1, owner = 'buyer', update_time = now()
                               FROM u WHERE r.id = u.id AND r.state = 1 AND r.version = u.v
                             RETURNING r.id, r.pool_id, r.version, u.rid)
               INSERT INTO t_allocation_history (resource_id, pool_id, action, owner, reservation_id, version)
               SELECT id, pool_id, 'allocate', 'buyer', rid, version FROM allocated
               RETURNING reservation_id || ' ' || resource_id AS landed`,
        values: [batch.flatMap((c) => c.ids), batch.flatMap((c) => c.versions), batch.flatMap((c) => c.ids.map(() => c.rid))],
      });
      const landed = new Set(res.rows.map((row) => row.landed));
      return batch.map((c) => c.ids.every((id) => landed.has(`${c.rid} ${id}`)));
    },
    MAX_BATCHES_IN_FLIGHT,
    MAX_COMMITS_PER_BATCH,
    10_000,
  );
  app.post<{ Body: { ttlMs?: number } }>('/reserve', async (req, reply) => {
    const r = (await call.minimal_reserve(base, `minimal.${randomUUID()}`, req.body?.ttlMs ?? 1000)) as string[];
    if (r.length === 0) return reply.status(409).send({ error: { code: 'POOL_EXHAUSTED' } });
    return reply.status(201).send({
      id: r[0],
      items: r[1].split(',').map((m) => ({ resourceId: m.split(':')[0] })),
      expiresAt: new Date(Number(r[2])).toISOString(),
    });
  });
  app.post<{ Params: { id: string }; Body: { resourceIds: string[] } }>('/reserve/:id/confirm', async (req, reply) => {
    const chosen = req.body.resourceIds;
    const pin = (await call.minimal_pin(base, req.params.id)) as string[];
    if (pin[0] !== 'pinned') return reply.status(409).send({ error: { code: 'HOLD_LOST' } });
    const versions = new Map(pin[1].split(',').map((m) => m.split(':') as [string, string]));
    if (chosen.length === 0 || chosen.some((id) => !versions.has(id))) {
      await call.minimal_end(base, req.params.id, 'confirming', 'released', ',');
      return reply.status(409).send({ error: { code: 'NOT_IN_RESERVATION' } });
    }
    const landed = await commits.submit({ rid: req.params.id, ids: chosen, versions: chosen.map((id) => Number(versions.get(id))) });
    await call.minimal_end(base, req.params.id, 'confirming', landed ? 'confirmed' : 'released', landed ? `,${chosen.join(',')},` : ',');
    if (!landed) return reply.status(409).send({ error: { code: 'HOLD_LOST' } });
    return reply
      .status(200)
      .send({ id: req.params.id, allocated: chosen.map((id) => ({ resourceId: id, version: Number(versions.get(id)) + 1 })) });
  });
  app.delete<{ Params: { id: string } }>('/reserve/:id', async (req, reply) => {
    const ended = await call.minimal_end(base, req.params.id, 'held', 'released', ',');
    return reply.status(Number(ended) === 1 ? 200 : 409).send({ id: req.params.id });
  });
} else if (mode === 'floor') {
  app.post('/reserve', async (_req, reply) =>
    reply.status(201).send({
      id: `floor.${randomUUID()}`,
      items: ['1', '2', '3'].map((id) => ({ resourceId: id, value: `value-${id}`, version: 1 })),
      expiresAt: new Date(Date.now() + 1000).toISOString(),
    }),
  );
} else {
  const db = new pg.Pool({ connectionString: url, max: 16 });
  const poolId = arg;
  const maxId = Number(maxIdArg);
  const minId = Number(process.argv[7] ?? 1);
  app.post('/allocate', async (_req, reply) => {
    for (let attempt = 0; attempt < 50; attempt++) {
      const pick = await db.query(`SELECT id, version FROM t_resource WHERE pool_id = $1 AND state = 1 AND id >= $2 ORDER BY id LIMIT 1`, [
        poolId,
        minId + Math.floor(Math.random() * (maxId - minId + 1)),
      ]);
      if (pick.rowCount === 0) continue;
      const { id, version } = pick.rows[0];
      const won = await db.query(
        `UPDATE t_resource SET state = 2, version = version + 1, owner = 'classic', update_time = now() WHERE id = $1 AND state = 1 AND version = $2`,
        [id, version],
      );
      if (won.rowCount === 1) return reply.status(200).send({ id: String(id), version: version + 1 });
    }
    return reply.status(409).send({ error: { code: 'POOL_EXHAUSTED' } });
  });
}

await app.listen({ port: Number(portArg), host: '127.0.0.1' });
console.log('ready');
