import { ArgumentMetadata, Injectable, PipeTransform, ValidationError } from '@nestjs/common';
import { plainToInstance } from 'class-transformer';
import { validateSync, ValidatorOptions } from 'class-validator';
import { compileDto, DtoClass } from './compiled-dto.js';
import { DomainError, FieldError } from './errors.js';
import { MAX_LISTED_FIELDS } from './http-errors.js';
import { MAX_ATTRIBUTES, MAX_IMPORT_ITEMS } from './validators.js';

/** Flattens class-validator's tree into `{ field: "filter.attributes", reason }` entries. */
export function flattenValidationErrors(errors: ValidationError[], parent = ''): FieldError[] {
  const out: FieldError[] = [];
  for (const error of errors) {
    const field = parent ? `${parent}.${error.property}` : error.property;
    if (error.constraints) {
      out.push({ field, reason: Object.values(error.constraints).join('; ') });
    }
    if (error.children?.length) out.push(...flattenValidationErrors(error.children, field));
  }
  return out;
}

/**
 * Why a string cannot be stored as sent, or null: Postgres' text holds no NUL character, and a lone UTF-16
 * surrogate (which JSON's `\uD800`-style escapes can write) is not Unicode text that Postgres, UTF-8 or
 * Redis' Lua JSON can take.
 */
function unstorable(text: string): string | null {
  if (text.includes('\0')) return 'must not contain the NUL character (\\u0000)';
  if (/\p{Surrogate}/u.test(text)) return 'must be well-formed Unicode text (JSON escapes \\ud800-\\udfff only as a surrogate pair)';
  return null;
}

/** The strings of a request, keys included, that cannot be stored as sent (see unstorable). Fields as `a.b.0.c`. */
export function malformedStrings(value: unknown, field = '', out: FieldError[] = []): FieldError[] {
  // Nearly every request has none: a walk that builds no field paths says so first.
  if (field === '' && allStorable(value)) return out;
  if (typeof value === 'string') {
    const reason = unstorable(value);
    if (reason) out.push({ field, reason });
  } else if (value !== null && typeof value === 'object') {
    for (const [key, inner] of Object.entries(value)) {
      const path = field ? `${field}.${key}` : key;
      const reason = unstorable(key);
      if (reason) out.push({ field: field || key, reason: `keys ${reason}` });
      malformedStrings(inner, path, out);
    }
  }
  return out;
}

/** True when every string of a JSON value, keys included, can be stored as sent. */
function allStorable(value: unknown): boolean {
  if (typeof value === 'string') return unstorable(value) === null;
  if (value === null || typeof value !== 'object') return true;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) if (!allStorable(value[i])) return false;
    return true;
  }
  for (const key in value) {
    if (!Object.hasOwn(value, key)) continue;
    if (unstorable(key) !== null || !allStorable((value as Record<string, unknown>)[key])) return false;
  }
  return true;
}

/** How deep a body may nest objects and arrays: no DTO needs more than 4 levels; the walks over a body recurse. */
export const MAX_BODY_DEPTH = 32;

/**
 * Fields and array elements in all that a valid body has at most: an import of MAX_IMPORT_ITEMS items, each with its
 * value, group key, attributes and MAX_ATTRIBUTES of them, and some to spare. A body with more is refused before its
 * fields are validated one by one: 900,000 unknown fields in an 8 MB body made 900,000 validation errors, which ran
 * the service out of memory (a review's finding).
 */
export const MAX_BODY_NODES = MAX_IMPORT_ITEMS * (4 + MAX_ATTRIBUTES) + 100;

/**
 * What is wrong with the shape of a JSON value, or null: nested more than `depthLimit` levels deep, or more than
 * `nodeLimit` fields and array elements in all (one walk, iteratively: any depth is safe).
 */
export function shapeFault(value: unknown, depthLimit: number, nodeLimit: number): 'deep' | 'large' | null {
  let nodes = 0;
  const values: unknown[] = [value];
  const depths: number[] = [1];
  const push = (inner: unknown, depth: number) => {
    if (inner !== null && typeof inner === 'object') {
      values.push(inner);
      depths.push(depth);
    }
  };
  while (values.length > 0) {
    const next = values.pop();
    const depth = depths.pop()!;
    if (next === null || typeof next !== 'object') continue;
    if (depth > depthLimit) return 'deep';
    if (Array.isArray(next)) {
      if ((nodes += next.length) > nodeLimit) return 'large';
      for (let i = 0; i < next.length; i++) push(next[i], depth + 1);
    } else {
      for (const key in next) {
        if (!Object.hasOwn(next, key)) continue;
        if (++nodes > nodeLimit) return 'large';
        push((next as Record<string, unknown>)[key], depth + 1);
      }
    }
  }
  return null;
}

/**
 * A request's path parameters and body, linked (linkRequestParts) so that a request bad in both is refused once with
 * the bad fields of both, the path's first. Nest starts the pipes of a handler's arguments one after the other (in the
 * order of its argument metadata, the body's before the path's on some routes), the first pipe of each synchronously,
 * and answers with the first error thrown; the pipe that refuses later adds its fields to that error (`refuse`), which
 * Nest writes out only after every pipe has run (a pipe later still would make the answer list fewer fields, no
 * other harm).
 */
const requestParts = new WeakMap<object, { refused?: DomainError }>();

/** A body that is not a JSON object or array (`null`, a number, a string, `true`), in an object that can be linked. */
export class NotAnObject {
  constructor(readonly value: unknown) {}
}

/**
 * What a request's pipes see as its body, linkable to its path parameters: `{}` for none (as the pipes take it), a
 * NotAnObject for `null`, a number, a string or a boolean; the body itself otherwise.
 */
export function linkableBody(body: unknown): unknown {
  if (body === undefined) return {};
  if (body === null) return new NotAnObject(null);
  return typeof body === 'object' ? body : new NotAnObject(body);
}

/**
 * Links a request's path parameters and body (linkableBody), before its pipes run. `pending`: bad fields found outside
 * them (the query string, a header), listed with theirs: the first of the request's pipes to refuse, or to pass, throws
 * them (so a route with `pending` must have a path parameter or a body its pipes validate; app.factory.ts refuses the
 * query string of another at once).
 */
export function linkRequestParts(params: unknown, body: unknown, pending?: FieldError[]): void {
  if (params === null || typeof params !== 'object' || body === null || typeof body !== 'object') return;
  const link: { refused?: DomainError } = pending ? { refused: DomainError.validation(pending) } : {};
  // A route without path parameters has nothing to link (and its params object may be one shared by every request):
  // only its body, which is the request's own, when something is pending.
  if (hasOwnKey(params)) requestParts.set(params, link);
  else if (!pending) return;
  requestParts.set(body, link);
}

export function hasOwnKey(value: object): boolean {
  for (const key in value) if (Object.hasOwn(value, key)) return true;
  return false;
}

/**
 * The error refusing `value` (a request's part: `type` "param" for its path) for `fields`: the one refusing another part
 * of its request, if any, with these fields added (a path's first).
 */
function refuse(value: unknown, fields: FieldError[], type: string): DomainError {
  const link = value !== null && typeof value === 'object' ? requestParts.get(value) : undefined;
  if (!link) return DomainError.validation(fields);
  if (!link.refused) return (link.refused = DomainError.validation(fields));
  const details = link.refused.details as { fields: FieldError[] };
  // concat, not push(...fields): a body may name hundreds of thousands of unknown fields.
  details.fields = type === 'param' ? fields.concat(details.fields) : details.fields.concat(fields);
  return link.refused;
}

export const VALIDATOR_OPTIONS: ValidatorOptions = { whitelist: true, forbidNonWhitelisted: true, forbidUnknownValues: true };
const UNVALIDATED = new Set<unknown>([String, Number, Boolean, Array, Object]);

/**
 * Validates every body and path with its DTO's class-validator decorators, synchronously: Nest's
 * ValidationPipe does the same work through promises and several extra passes over the value, which
 * the profile showed at a sixth of a confirm's CPU time. Unknown fields are refused, like everything
 * else that fails, with 400 VALIDATION_FAILED and `details.fields`, and so are strings (keys included) that
 * cannot be stored as sent: holding a NUL character or a lone surrogate.
 *
 * A valid value takes the DTO's compiled form (`compiled-dto.ts`): class-transformer's and
 * class-validator's general machinery was still 15 % of a reserve's CPU time and 40 % of the memory
 * it allocates. Whatever the compiled check refuses is validated by class-validator itself, which
 * writes the messages.
 */
@Injectable()
export class DtoValidationPipe implements PipeTransform {
  transform(value: unknown, { metatype, type }: ArgumentMetadata): unknown {
    if (type === 'custom' || !metatype || UNVALIDATED.has(metatype)) return value;
    const plain = value === undefined ? {} : value;
    if (plain === null || typeof plain !== 'object' || Array.isArray(plain) || plain instanceof NotAnObject) {
      throw refuse(value, [{ field: type, reason: `the ${type} must be a JSON object` }], type);
    }
    const shape = shapeFault(plain, MAX_BODY_DEPTH, MAX_BODY_NODES);
    if (shape) throw refuse(value, [{ field: type, reason: shapeReason(type, shape) }], type);
    const cls = metatype as DtoClass;
    const dto = compileDto(cls);
    const skipped: string[] = [];
    const instance = dto ? dto.build(plain, skipped) : plainToInstance(cls, plain);
    const malformed = malformedStrings(plain);
    if (malformed.length === 0 && skipped.length === 0 && dto?.passes(instance)) return passed(value, instance);
    // So many unknown fields that only some can be listed: refused without validateSync's error object for each (a
    // body of 360,000 took 1.6 s of CPU).
    const unknownFields = dto?.unknownFields(plain, MAX_LISTED_FIELDS);
    if (unknownFields && unknownFields.count > MAX_LISTED_FIELDS) {
      const refused = refuse(value, unknownFields.fields.map(unknownField), type);
      const details = refused.details as { fieldsOmitted?: number };
      details.fieldsOmitted = (details.fieldsOmitted ?? 0) + unknownFields.count - unknownFields.fields.length;
      throw refused;
    }
    const unknown = skipped.map(unknownField);
    const errors = [...flattenValidationErrors(validateSync(instance, VALIDATOR_OPTIONS)), ...unknown, ...malformed];
    if (errors.length > 0) throw refuse(value, errors, type);
    return passed(value, instance);
  }
}

function unknownField(field: string): FieldError {
  return { field, reason: `property ${field.slice(field.lastIndexOf('.') + 1)} should not exist` };
}

function shapeReason(type: string, shape: 'deep' | 'large'): string {
  return shape === 'deep'
    ? `the ${type} nests objects or arrays more than ${MAX_BODY_DEPTH} levels deep`
    : `the ${type} has more than ${MAX_BODY_NODES} fields and array elements in all`;
}

/** A valid part of a request: its DTO, unless bad fields are pending for the request (linkRequestParts). */
function passed<T>(value: unknown, instance: T): T {
  const refused = requestParts.get(value as object)?.refused;
  if (refused) throw refused;
  return instance;
}

/**
 * The body of a route that takes none: no body or `{}` pass; a field is refused like any unknown field, and so is a
 * body that is not an object (`null` included). See `NO_BODY` for the route's OpenAPI entry.
 */
@Injectable()
export class NoBodyPipe implements PipeTransform {
  transform(value: unknown): undefined {
    if (value === undefined) return undefined;
    if (value === null || typeof value !== 'object' || Array.isArray(value) || value instanceof NotAnObject) {
      throw refuse(value, [{ field: 'body', reason: 'this route takes no body (or {})' }], 'body');
    }
    if (shapeFault(value, MAX_BODY_DEPTH, MAX_BODY_NODES) === 'large') {
      throw refuse(value, [{ field: 'body', reason: shapeReason('body', 'large') }], 'body');
    }
    const fields = Object.keys(value);
    if (fields.length > 0)
      throw refuse(
        value,
        fields.map((field) => ({ field, reason: `property ${field} should not exist` })),
        'body',
      );
    return undefined;
  }
}

/** The OpenAPI entry of a route that takes no body (`@ApiBody(NO_BODY)`, beside `@Body(NoBodyPipe)`). */
export const NO_BODY = {
  required: false,
  description: 'None (an empty object is accepted too)',
  schema: { type: 'object' as const, maxProperties: 0 },
};

export function createValidationPipe(): DtoValidationPipe {
  return new DtoValidationPipe();
}
