-- Shared helpers. When a script of this folder is loaded, the helpers it uses (directly or through another
-- helper) are put in front of it, and no others (src/redis/lua-prelude.ts): so this file holds only
-- `local function` blocks, each ending with an `end` at the start of a line, its comment right above it.
--
-- Key layout of a pool (every key carries the pool in a {hash tag}: one Redis Cluster slot a pool):
--   <base>free           ZSET, score 0, member "<value>\0<id>": the free, unheld items (lex order = value prefix search)
--   <base>item:<bucket>  HASH id -> item JSON {"id","v" value,"n" version,"g" groupKey,"a" attributes; "g" and "a"
--                        left out when empty}, for every unallocated item. Bucket = the id without its last two
--                        digits: at most 100 fields a hash, which Redis keeps as a compact listpack (about a third
--                        of the memory of one big hash table)
--   <base>fz:<k>\0<v>    ZSET, score 0, of the free members whose attribute k equals v (lex order: the members of
--                        an attribute with a value prefix form one range of it)
--   <base>fg:<group>     SET of free members of a task group
--   <base>h:<id>         STRING, the hold: reservation id (PX = its expiry), or "A:<version>" for a while after the
--                        item was allocated at that version (a rebuild may not re-add it from an older read)
--   <base>r:<rid>        HASH, the reservation (fields below)
--   <base>exp            ZSET rid -> ms at which the sweeper must look at it (expiry, or end of a commit pin)
--   <base>oh             HASH owner -> items held now (maxHoldsPerOwner)
--   <base>og:<owner>     HASH group -> live leases of that owner in the group (task affinity)
--   <base>idem:<key>     STRING "<rid>\n<body hash>", PX = idempotency TTL
--   <base>gen            STRING, the Redis generation this pool's free index was built in (see t_redis_generation)
--   <base>kr             STRING, the rebuild round putting the pool's Idempotency-Keys back, until it writes gen
--   <base>wq:<line>      ZSET "<count> <rid>" -> its turn: the reserves waiting (waitMs) in one filter's line, in order
--   <base>wn:<line>      STRING, the last turn given in the line (INCR)
--   <base>wl:<line>      ZSET, the same members -> ms at which each one's place lapses unless it tries again
--   <base>ww             STRING, present while a reserve waits (waitMs) in the pool: it tried within its place's life
-- Channel <base>freed: the items that came free in the pool, published while <base>ww exists (wake_waiters)
-- Reservation fields: o owner, k kind ("r" reservation, "l" lease), s state (held, confirming, confirmed,
-- released, expired), i items (JSON array of item JSON), c created ms, e expires ms, x outcome JSON,
-- sel confirmed selection (sorted ids, comma separated), cnt "1" while its items count in oh/og,
-- ep the commit epoch: incremented by each pin that starts a commit (Postgres records who ended each epoch), pn the
-- number of pins so far (never reset; unpin acts only for the last pin), ad the last epoch Postgres is known to have
-- ended while the hold was due (abort's "held again", unpin): its holds are plain ones again (see extend), eo the
-- attempt token of the pin that opened the current epoch, rt the ids it took back and op its number (a pin sent twice
-- answers as its first run did),
-- g the Redis generation the holds were taken in (a commit lands only in that generation), ik the Idempotency-Key it
-- was made with and its body hash ("<key>\n<hash>"; absent for none): a confirm records them in Postgres.

local function tombstone(version)
  return 'A:' .. version
end

local function is_tombstone(holder)
  return holder and string.sub(holder, 1, 2) == 'A:'
end

-- True when a tombstone is older than this item version (the item was released since its allocation).
local function tombstone_stale(holder, version)
  return is_tombstone(holder) and tonumber(string.sub(holder, 3)) < version
end

local function item_key(base, id)
  local bucket = string.sub(id, 1, -3)
  if bucket == '' then bucket = '0' end
  return base .. 'item:' .. bucket
end

-- The cached JSON of an unallocated item, or false.
local function item_get(base, id)
  return redis.call('HGET', item_key(base, id), id)
end

local function item_set(base, id, json)
  redis.call('HSET', item_key(base, id), id, json)
end

local function item_del(base, id)
  redis.call('HDEL', item_key(base, id), id)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function member_of(item)
  return item.v .. '\0' .. item.id
end

local function id_of(member)
  local i = #member
  while i > 0 and string.byte(member, i) ~= 0 do i = i - 1 end
  return string.sub(member, i + 1)
end

local function has_group(item)
  return item.g ~= nil and item.g ~= cjson.null
end

local function attr_key(base, k, v)
  return base .. 'fz:' .. k .. '\0' .. v
end

-- Removes an item from every free index (m: its member, when the caller has it already).
local function unindex(base, item, m)
  m = m or member_of(item)
  redis.call('ZREM', base .. 'free', m)
  if type(item.a) == 'table' then
    for k, v in pairs(item.a) do redis.call('ZREM', attr_key(base, k, v), m) end
  end
  if has_group(item) then redis.call('SREM', base .. 'fg:' .. item.g, m) end
end

-- Whether a reserve waits in the pool now (<base>ww, set by reserve.lua): the script then tells (wake_waiters).
local function waited_in(base)
  return redis.call('EXISTS', base .. 'ww') == 1
end

-- Puts items into every free index, all of them in one ZADD; returns how many of them were not free before, and, if
-- `waited` (waited_in), which (for wake_waiters; else nil).
local function index_all(base, items, waited)
  if #items == 0 then return 0, nil end
  local scored = {}
  for _, item in ipairs(items) do
    local m = member_of(item)
    scored[#scored + 1], scored[#scored + 2] = 0, m
    if type(item.a) == 'table' then
      for k, v in pairs(item.a) do redis.call('ZADD', attr_key(base, k, v), 0, m) end
    end
    if has_group(item) then redis.call('SADD', base .. 'fg:' .. item.g, m) end
  end
  local fresh = nil
  if waited then
    local members = {}
    for i = 1, #items do members[i] = scored[2 * i] end
    local scores = redis.call('ZMSCORE', base .. 'free', unpack(members))
    fresh = {}
    for i, item in ipairs(items) do
      if not scores[i] then fresh[#fresh + 1] = item end
    end
  end
  return redis.call('ZADD', base .. 'free', unpack(scored)), fresh
end

-- Tells the instances whose reserves wait in this pool which items came free (those index_all found not free before,
-- while waited_in), so that the waiters they may serve try again at once (WakeUps): a JSON array of their values and
-- attributes, or for more than 32 items (or items cjson cannot write) only how many. Nothing is sent for none. With
-- pcall: a refused PUBLISH (a Redis user without the channel) must not stop the script halfway, nor fail it.
local function wake_waiters(base, items)
  if not items or #items == 0 then return end
  local message = tostring(#items)
  if #items <= 32 then
    local listed = {}
    for i, item in ipairs(items) do listed[i] = { v = item.v, a = item.a } end
    local ok, json = pcall(cjson.encode, listed)
    if ok then message = json end
  end
  redis.pcall('PUBLISH', base .. 'freed', message)
end

-- Appends the items of `more` (nil: none) to `list`; returns `list`.
local function append_items(list, more)
  if more then
    for _, item in ipairs(more) do list[#list + 1] = item end
  end
  return list
end

-- Puts an item into every free index; returns 1 if it was not free before.
local function index(base, item)
  return (index_all(base, { item }))
end

local function decode_items(json)
  if not json then return {} end
  return cjson.decode(json)
end

-- True when `item` is an item as respool writes it: string id and value, numeric version, and, if present, a
-- string group and a table of string attributes.
local function well_formed(item)
  if type(item) ~= 'table' or type(item.id) ~= 'string' or type(item.v) ~= 'string' or type(item.n) ~= 'number' then
    return false
  end
  if item.g ~= nil and item.g ~= cjson.null and type(item.g) ~= 'string' then return false end
  if item.a ~= nil then
    if type(item.a) ~= 'table' then return false end
    for k, v in pairs(item.a) do
      if type(k) ~= 'string' or type(v) ~= 'string' then return false end
    end
  end
  return true
end

-- A cached item's JSON decoded, or nil when there is none or it is not a well-formed item (a hand edit of
-- Redis, or a row with non-string attributes cached before Postgres refused them): callers treat it as no
-- cache entry, which the rebuild writes again from Postgres if it can.
local function decode_item(json)
  if not json then return nil end
  local ok, item = pcall(cjson.decode, json)
  if ok and well_formed(item) then return item end
  return nil
end

-- A reservation's items decoded: the well-formed ones, and as many entries as the list has with the others
-- replaced by empty tables (to count them); {}, nil when its JSON is not a list.
local function decode_items_safely(json)
  local ok, items = pcall(decode_items, json)
  if not ok or type(items) ~= 'table' or (#items == 0 and next(items) ~= nil) then return {}, nil end
  local good, counted = {}, {}
  for i, item in ipairs(items) do
    if well_formed(item) then
      good[#good + 1], counted[i] = item, item
    else
      counted[i] = {}
    end
  end
  return good, counted
end

-- Adjusts the per-owner counters of a reservation's items (delta +1 or -1 per item).
local function count_items(base, owner, kind, items, delta)
  if #items == 0 then return end
  local left = redis.call('HINCRBY', base .. 'oh', owner, delta * #items)
  if left <= 0 then redis.call('HDEL', base .. 'oh', owner) end
  if kind == 'l' then
    local og = base .. 'og:' .. owner
    for _, item in ipairs(items) do
      if has_group(item) then
        local n = redis.call('HINCRBY', og, item.g, delta)
        if n <= 0 then redis.call('HDEL', og, item.g) end
      end
    end
  end
end

-- Drops the holds this reservation still has and returns those items to the free index. `keep_own`: the
-- items this reservation still holds stay held (their commit is undecided); only those whose hold ran out go
-- back. An item whose hold ran out goes back only if it has a cache entry: with none, it was allocated
-- meanwhile (finish drops the entry). An item held by this reservation until now was not (nothing allocates
-- an item another reservation holds), so its entry is not looked up; should one be missing all the same (a
-- hand edit, a finish that came after its own hold ran out), reserve drops the index entry it meets without one.
-- Returns how many were not free before, and, if `waited` (waited_in), which (see index_all).
local function free_items(base, rid, items, keep_own, waited)
  local back = {}
  for _, item in ipairs(items) do
    local hkey = base .. 'h:' .. item.id
    local holder = redis.call('GET', hkey)
    if holder == rid then
      if not keep_own then
        redis.call('DEL', hkey)
        back[#back + 1] = item
      end
    elseif not holder and redis.call('HEXISTS', item_key(base, item.id), item.id) == 1 then
      back[#back + 1] = item
    end
  end
  return index_all(base, back, waited)
end

-- A reservation's fields by name, read in one call (a field it lacks is false), or nil if there is none.
local function read_reservation(rkey)
  local f = redis.call('HMGET', rkey, 's', 'o', 'k', 'c', 'e', 'i', 'x', 'ep', 'g', 'pw', 'cnt', 'sel', 'pn')
  if not f[1] then return nil end
  return { s = f[1], o = f[2], k = f[3], c = f[4], e = f[5], i = f[6], x = f[7], ep = f[8], g = f[9], pw = f[10], cnt = f[11], sel = f[12], pn = f[13] }
end

-- The reply describing a reservation from its fields (as read_reservation gives them, or as just written).
local function reply_of(status, rid, r, now)
  return { status, rid, r.s or '', r.o or '', r.k or '', r.c or '', r.e or '', r.i or '[]', r.x or '', tostring(now), r.ep or '0', r.g or '0', r.pw or '0' }
end

local function reservation_reply(status, rid, rkey, now)
  return reply_of(status, rid, read_reservation(rkey) or {}, now)
end

-- Stops counting a reservation's items against its owner, once (r: its fields as read_reservation gave
-- them). Adds the write that records it to `fields`, the field-value list of the caller's HSET, and
-- returns that list.
local function uncount_into(base, r, items, fields)
  if r.cnt == '1' then
    count_items(base, r.o, r.k, items, -1)
    local n = #fields
    fields[n + 1], fields[n + 2] = 'cnt', '0'
  end
  return fields
end
