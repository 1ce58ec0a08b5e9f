import type { Redis } from 'ioredis';

// One atomic snapshot of a pool's holds (a script runs alone in Redis): for every reservation that is
// held or committing, the items whose hold key names it; and the ids in the free index.
const SNAPSHOT = `
local base = ARGV[1]
local held = {}
for _, key in ipairs(redis.call('KEYS', base .. 'r:*')) do
  local state = redis.call('HGET', key, 's')
  if state == 'held' or state == 'confirming' then
    local rid = string.sub(key, #base + 3)
    for _, item in ipairs(cjson.decode(redis.call('HGET', key, 'i'))) do
      if redis.call('GET', base .. 'h:' .. item.id) == rid then held[#held + 1] = item.id .. ' ' .. rid end
    end
  end
end
return { held, redis.call('ZRANGE', base .. 'free', 0, -1) }`;

/** Live holds of the pool whose key base is `base`: item id -> reservation ids; and the free item ids. */
export async function holdSnapshot(redis: Redis, base: string): Promise<{ holders: Map<string, string[]>; free: string[] }> {
  const [held, free] = (await redis.eval(SNAPSHOT, 0, base)) as [string[], string[]];
  const holders = new Map<string, string[]>();
  for (const entry of held) {
    const [id, rid] = entry.split(' ');
    holders.set(id, [...(holders.get(id) ?? []), rid]);
  }
  return { holders, free: free.map((m) => m.slice(m.lastIndexOf('\0') + 1)) };
}
