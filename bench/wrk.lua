-- Requests for wrk (bench/wrk.ts). Either one fixed request (WRK_METHOD, WRK_PATH, WRK_BODY), or, with
-- WRK_REQUESTS naming a file of "method<TAB>path<TAB>body" lines, each line sent once: thread k of n
-- takes lines k, k+n, ... ; a thread that has used all of its lines sends GET /health/live, counted
-- apart as "ran dry". No response() callback: wrk then parses responses in C only and counts the
-- non-2xx/3xx ones itself. done() prints one JSON line with the counts and the latency percentiles.
local threads = {}
local thread_count = tonumber(os.getenv('WRK_THREADS') or '1')
local next_index = 0

function setup(thread)
  thread:set('index', next_index)
  next_index = next_index + 1
  table.insert(threads, thread)
end

-- Per thread. dry is a global: done() reads it with thread:get.
local requests = nil
local position = 0
dry = 0
local fixed = nil
local dry_request = nil

-- A request with a JSON body, or without a body (and then without a content-type).
local function format(method, path, body)
  if body == nil or body == '' then return wrk.format(method, path, {}) end
  return wrk.format(method, path, { ['content-type'] = 'application/json' }, body)
end

function init(args)
  dry_request = wrk.format('GET', '/health/live')
  local file = os.getenv('WRK_REQUESTS')
  if file == nil or file == '' then
    fixed = format(os.getenv('WRK_METHOD') or 'GET', os.getenv('WRK_PATH') or '/', os.getenv('WRK_BODY'))
    return
  end
  requests = {}
  local line_no = 0
  for line in io.lines(file) do
    if line_no % thread_count == index then
      local method, path, body = line:match('^([^\t]*)\t([^\t]*)\t(.*)$')
      table.insert(requests, format(method, path, body))
    end
    line_no = line_no + 1
  end
  -- wrk calls request() once on the first thread to check it, before the run: give it a copy of the
  -- first line to use up, so every line is still sent.
  if index == 0 and #requests > 0 then table.insert(requests, 1, requests[1]) end
end

function request()
  if fixed then return fixed end
  position = position + 1
  if position > #requests then
    dry = dry + 1
    return dry_request
  end
  return requests[position]
end

-- latency: wrk 4 corrects it for coordinated omission before done() (it adds the samples a request
-- would have produced had it been sent on schedule), so its percentiles are above a raw measurement's.
function done(summary, latency, requests_)
  local ran_dry = 0
  for _, thread in ipairs(threads) do ran_dry = ran_dry + thread:get('dry') end
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"durationUs":%d,"errors":%d,"non2xx":%d,"ranDry":%d,"p50Us":%d,"p99Us":%d}\n',
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, ran_dry, latency:percentile(50), latency:percentile(99)))
end
