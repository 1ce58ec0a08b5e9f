/**
 * Puts in front of a script the helpers of the shared prelude (_lib.lua) it uses, and only those.
 *
 * Redis runs a script's whole body on every EVALSHA, so each `local function` of the prelude costs a closure
 * each call whether the script uses it or not: the whole prelude cost about as many instructions as an empty
 * EVALSHA (`npm run bench:redis-ir`). The prelude is a list of `local function name(...) ... end` blocks, each
 * with the comment above it; a block is kept when the script's code, or a kept block's, names it. Blocks keep
 * their order in _lib.lua, so a helper is still defined before the helpers that call it.
 */

import { readFileSync } from 'node:fs';

interface Helper {
  name: string;
  /** The block as written: its comment, its definition. */
  text: string;
  /** Its code without comments, to look for the helpers it calls. */
  code: string;
}

const DEFINITION = /^local function ([A-Za-z_][A-Za-z0-9_]*)\s*\(/;

/** Lua source without its `--` comments (the scripts have no long comments, nor `--` inside strings). */
export function withoutComments(lua: string): string {
  return lua.replace(/--.*$/gm, '');
}

/**
 * The prelude's helpers in order. Each is a `local function` whose `end` is at the start of a line, with the
 * comment lines right above it; the file's header comment (the key layout) is dropped.
 */
export function parseHelpers(lib: string): Helper[] {
  const helpers: Helper[] = [];
  let comment: string[] = [];
  let current: { name: string; lines: string[] } | null = null;
  for (const line of lib.split('\n')) {
    if (current) {
      current.lines.push(line);
      if (line.trimEnd() === 'end') {
        const text = current.lines.join('\n');
        helpers.push({ name: current.name, text, code: withoutComments(text) });
        current = null;
      }
      continue;
    }
    const definition = DEFINITION.exec(line);
    if (definition) {
      current = { name: definition[1], lines: [...comment, line] };
      comment = [];
    } else if (line.startsWith('--')) {
      comment.push(line);
    } else if (line.trim() === '') {
      comment = [];
    } else {
      throw new Error(`_lib.lua: only "local function" blocks may follow the header, found: ${line}`);
    }
  }
  if (current) throw new Error(`_lib.lua: ${current.name} has no "end" at the start of a line`);
  const names = new Set<string>();
  for (const h of helpers) {
    if (names.has(h.name)) throw new Error(`_lib.lua: ${h.name} is defined twice`);
    names.add(h.name);
  }
  return helpers;
}

function names(code: string, candidates: readonly Helper[]): Set<string> {
  const found = new Set<string>();
  for (const h of candidates) {
    if (new RegExp(`(?<![A-Za-z0-9_.:])${h.name}(?![A-Za-z0-9_])`).test(code)) found.add(h.name);
  }
  return found;
}

/** The script with the helpers it needs (directly or through another helper) in front of it. */
export function withPrelude(lib: string, script: string): string {
  const helpers = parseHelpers(lib);
  const needed = names(withoutComments(script), helpers);
  // A helper only calls helpers defined above it: one pass from the bottom up gathers every one needed.
  for (let i = helpers.length - 1; i >= 0; i--) {
    const h = helpers[i];
    if (!needed.has(h.name)) continue;
    for (const callee of names(h.code, helpers.slice(0, i))) needed.add(callee);
  }
  const kept = helpers.filter((h) => needed.has(h.name)).map((h) => h.text);
  return kept.length ? `${kept.join('\n\n')}\n\n${script}` : script;
}

/** Script `name` of folder `dir` (src/redis/scripts, or its copy in dist) as Redis runs it: withPrelude applied. */
export function loadScript(dir: URL, name: string): string {
  const read = (file: string) => readFileSync(new URL(`${file}.lua`, dir), 'utf8');
  return withPrelude(read('_lib'), read(name));
}
