import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { parseHelpers, withPrelude } from '../../src/redis/lua-prelude.js';

const LIB = `-- Header: the key layout, which no script needs.
--
-- more header

local function index_all(base, items)
  return #items
end

-- One item; calls index_all.
local function index(base, item)
  return index_all(base, { item })
end

local function unindex(base, item)
  -- index is not called here, only named in this comment
  return 0
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1])
end`;

const definedIn = (lua: string) => [...lua.matchAll(/^local function (\w+)/gm)].map((m) => m[1]);

describe('the shared Lua prelude: a script carries the helpers it uses', () => {
  it('keeps the helpers a script names and those they call, in the prelude order, each with its comment', () => {
    const script = withPrelude(LIB, 'return index(ARGV[1], {})');
    expect(definedIn(script)).toEqual(['index_all', 'index']);
    expect(script).toContain('-- One item; calls index_all.\nlocal function index(');
    expect(script).not.toContain('Header');
    expect(script.endsWith('\n\nreturn index(ARGV[1], {})')).toBe(true);
  });

  it('goes by whole names in code: not by comments, longer names, or fields of a table', () => {
    const script = withPrelude(LIB, '-- now_ms is not called\nlocal x = r.index or unindex(b, i)\nreturn x.now_ms');
    expect(definedIn(script)).toEqual(['unindex']);
  });

  it('adds nothing to a script that uses no helper', () => {
    expect(withPrelude(LIB, 'return 1')).toBe('return 1');
  });

  it('refuses a prelude it cannot split into helpers', () => {
    expect(() => parseHelpers(`${LIB}\n\nlocal LIMIT = 5`)).toThrow('only "local function" blocks');
    expect(() => parseHelpers('local function open()\n  return 1\n  end')).toThrow('open has no "end"');
    expect(() => parseHelpers(`${LIB}\n\n${LIB.slice(LIB.indexOf('local function now_ms'))}`)).toThrow('now_ms is defined twice');
  });

  it("splits the service's own _lib.lua into every helper it defines", () => {
    const lib = readFileSync(new URL('../../src/redis/scripts/_lib.lua', import.meta.url), 'utf8');
    const helpers = parseHelpers(lib);
    expect(helpers.map((h) => h.name)).toEqual(definedIn(lib));
    // Each block is one whole function: the blocks, joined, hold every line of code of the file.
    const code = (lua: string) => lua.split('\n').filter((l) => l.trim() !== '' && !l.startsWith('--'));
    expect(helpers.flatMap((h) => code(h.text))).toEqual(code(lib));
  });
});
