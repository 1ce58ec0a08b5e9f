-- abort: ends a reservation whose commit did not happen (a version conflict, or a commit that stalled
-- and never reached Postgres). The reservation becomes expired and its items return to the free index,
-- with what Postgres says now: items allocated there get an allocation tombstone instead, items whose
-- version moved on are re-cached with the new version.
-- ARGV: 1 base, 2 rid, 3 retention ms, 4 tombstone ms, 5 ids allocated in Postgres (comma separated),
--       6.. fresh item JSON for items whose version changed
-- Returns: items returned to the free index, or -1 if the reservation is not in a commit any more
local base, rid, retention, tombstone = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'o', 'k', 'i')
if f[1] ~= 'confirming' then return -1 end
local items = decode_items(f[4])
uncount(base, rkey, f[2], f[3], items)

local allocated = {}
for id in string.gmatch(ARGV[5], '[^,]+') do allocated[id] = true end
local fresh = {}
for i = 6, #ARGV do
  local item = cjson.decode(ARGV[i])
  fresh[item.id] = { item = item, json = ARGV[i] }
end

local back = {}
for _, item in ipairs(items) do
  local hkey = base .. 'h:' .. item.id
  local holder = redis.call('GET', hkey)
  if allocated[item.id] then
    if holder == rid or not holder then redis.call('SET', hkey, ALLOCATED, 'PX', tombstone) end
    redis.call('HDEL', base .. 'item', item.id)
    unindex(base, item)
  elseif fresh[item.id] then
    redis.call('HSET', base .. 'item', item.id, fresh[item.id].json)
    back[#back + 1] = fresh[item.id].item
  else
    back[#back + 1] = item
  end
end
local freed = free_items(base, rid, back)
redis.call('HSET', rkey, 's', 'expired')
redis.call('PEXPIRE', rkey, retention)
redis.call('ZREM', base .. 'exp', rid)
return freed
