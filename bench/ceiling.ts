/**
 * Baseline servers for the bench, each a bare Fastify process:
 *   ceiling  POST /reserve: the single EVALSHA of respool's reserve script (count 3), nothing else
 *            (plus respool's sweep script on a timer, so the pool keeps flowing as it does in respool);
 *   minimal  POST /reserve: the least a TTL-hold reserve of 3 can do in Redis, as a floor: SPOP 3 ids from a
 *            set, a hold key each, the reservation and its expiry entry; a sweep returns expired ones. No
 *            value prefix or attribute search, no quotas, no idempotency, no generation check;
 *   floor    POST /reserve: a fixed JSON answer of a reservation's size, no Redis: what the machine gives a
 *            request that does nothing;
 *   classic  POST /allocate: DESIGN.md's classic design: pick a random free row, then the version-checked
 *            UPDATE, retry on conflict.
 * Usage: node ceiling.js <ceiling|minimal|floor|classic> <port> <redisUrl|databaseUrl> <prefix|poolId> [maxId]
 */
import Fastify from 'fastify';
import { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import pg from 'pg';
import { MAX_BATCHES_PER_TICK, SWEEP_BATCH } from '../src/sweeper/sweep-limits.js';

const [mode, portArg, url, arg, maxIdArg] = process.argv.slice(2);
const app = Fastify({ logger: false });

if (mode === 'ceiling') {
  const scripts = new URL('../../src/redis/scripts/', import.meta.url);
  const lib = readFileSync(new URL('_lib.lua', scripts), 'utf8');
  const redis = new Redis(url);
  redis.defineCommand('rp_reserve', { numberOfKeys: 1, lua: `${lib}\n${readFileSync(new URL('reserve.lua', scripts), 'utf8')}` });
  redis.defineCommand('rp_sweep', { numberOfKeys: 1, lua: `${lib}\n${readFileSync(new URL('sweep.lua', scripts), 'utf8')}` });
  const base = `${arg}{ceiling}:`;
  const call = redis as unknown as Record<string, (...args: unknown[]) => Promise<string[]>>;
  // respool's sweeper, as respool runs it: batches until nothing is due, every 250 ms.
  const sweep = async () => {
    for (let i = 0; i < MAX_BATCHES_PER_TICK; i++) {
      const swept = (await call.rp_sweep(`${base}free`, base, SWEEP_BATCH, 60_000, 15_000)) as unknown as number[];
      if (Number(swept[0]) < SWEEP_BATCH) break;
    }
  };
  setInterval(() => void sweep().catch(() => undefined), 250).unref();
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
    );
    if (r[0] !== 'ok') return reply.status(409).send({ error: { code: 'POOL_EXHAUSTED' } });
    return reply.status(201).send({ id: r[1], items: JSON.parse(r[7]), expiresAt: new Date(Number(r[6])).toISOString() });
  });
} else if (mode === 'minimal') {
  const redis = new Redis(url);
  const base = `${arg}{minimal}:`;
  // KEYS: none. ARGV: base, rid, ttlMs. Returns {rid, "id,id,id", expiresMs} or {} when the pool is dry.
  redis.defineCommand('minimal_reserve', {
    numberOfKeys: 0,
    lua: `local base, rid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ids = redis.call('SPOP', base .. 'free', 3)
if #ids < 3 then
  if #ids > 0 then redis.call('SADD', base .. 'free', unpack(ids)) end
  return {}
end
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for _, id in ipairs(ids) do redis.call('SET', base .. 'h:' .. id, rid, 'PX', ttl) end
local items = table.concat(ids, ',')
redis.call('HSET', base .. 'r:' .. rid, 'i', items, 'e', expires)
redis.call('PEXPIRE', base .. 'r:' .. rid, ttl + 60000)
redis.call('ZADD', base .. 'exp', expires, rid)
return { rid, items, tostring(expires) }`,
  });
  // ARGV: base, batch. Returns the number of reservations expired.
  redis.defineCommand('minimal_sweep', {
    numberOfKeys: 0,
    lua: `local base, batch = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', base .. 'exp', '-inf', now, 'LIMIT', 0, batch)
for _, rid in ipairs(due) do
  local items = redis.call('HGET', base .. 'r:' .. rid, 'i')
  if items then
    for id in string.gmatch(items, '[^,]+') do
      if redis.call('GET', base .. 'h:' .. id) == rid then redis.call('DEL', base .. 'h:' .. id) end
      redis.call('SADD', base .. 'free', id)
    end
    redis.call('DEL', base .. 'r:' .. rid)
  end
  redis.call('ZREM', base .. 'exp', rid)
end
return #due`,
  });
  const call = redis as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
  const sweep = async () => {
    for (let i = 0; i < MAX_BATCHES_PER_TICK; i++) if (Number(await call.minimal_sweep(base, SWEEP_BATCH)) < SWEEP_BATCH) break;
  };
  setInterval(() => void sweep().catch(() => undefined), 250).unref();
  app.post('/reserve', async (_req, reply) => {
    const r = (await call.minimal_reserve(base, `minimal.${randomUUID()}`, 1000)) as string[];
    if (r.length === 0) return reply.status(409).send({ error: { code: 'POOL_EXHAUSTED' } });
    return reply.status(201).send({
      id: r[0],
      items: r[1].split(',').map((id) => ({ resourceId: id })),
      expiresAt: new Date(Number(r[2])).toISOString(),
    });
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
