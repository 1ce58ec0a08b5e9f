import { ValidateIf, ValidationOptions, registerDecorator } from 'class-validator';

/**
 * A property that may be left out, and is then not checked; sent, it is checked, `null` included (refused by its
 * type's check). `@IsOptional` skips `null` too, which would take a `null` as "the default" for a field whose
 * schema says nothing of null.
 */
export const Omittable = (): PropertyDecorator => ValidateIf((_object: object, value: unknown) => value !== undefined);

export const POOL_NAME = /^[a-z0-9][a-z0-9_-]{0,62}$/;
/** Resource ids are Postgres bigints, sent as decimal strings: 1 to 9223372036854775807. */
export const RESOURCE_ID = /^[1-9][0-9]{0,18}$/;
const BIGINT_MAX = 9223372036854775807n;

export function isResourceId(value: unknown): boolean {
  return typeof value === 'string' && RESOURCE_ID.test(value) && BigInt(value) <= BIGINT_MAX;
}

/** A resource id (or, with `each`, an array of them). */
export function IsResourceId(options?: ValidationOptions): PropertyDecorator {
  return (target: object, propertyName: string | symbol) => {
    registerDecorator({
      name: 'isResourceId',
      target: target.constructor,
      propertyName: String(propertyName),
      options: { message: options?.each ? 'each value in $property must be a resource id' : '$property must be a resource id', ...options },
      validator: { validate: isResourceId },
    });
  };
}

/**
 * Characters in a string as Postgres and JSON Schema's `maxLength` count them: Unicode code points (a
 * surrogate pair is one). class-validator's `@Length` counts otherwise (validator.js leaves U+FE0E and
 * U+FE0F out), so a value it passed could be longer than its `varchar` column and fail in Postgres.
 */
export function charLength(s: string): number {
  let n = s.length;
  for (let i = 0; i < s.length - 1; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff) {
      const d = s.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) {
        n--;
        i++;
      }
    }
  }
  return n;
}

/** A string of `min` to `max` characters, counted as `charLength` counts them. */
export function IsCharLength(min: number, max: number, options?: ValidationOptions): PropertyDecorator {
  return (target: object, propertyName: string | symbol) => {
    registerDecorator({
      name: 'isCharLength',
      target: target.constructor,
      propertyName: String(propertyName),
      constraints: [min, max],
      options: { message: `$property must be a string of ${min} to ${max} characters`, ...options },
      validator: {
        validate(value: unknown): boolean {
          if (typeof value !== 'string') return false;
          const n = charLength(value);
          return n >= min && n <= max;
        },
      },
    });
  };
}

/** Items one import takes at most. */
export const MAX_IMPORT_ITEMS = 10_000;
export const MAX_ATTRIBUTES = 32;
export const MAX_ATTRIBUTE_KEY = 64;
export const MAX_ATTRIBUTE_VALUE = 256;

/** A plain object (not an array) whose values are all strings: what the Redis scripts can index as attributes. */
export function isStringRecord(value: unknown): value is Record<string, string> {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) return false;
  return Object.values(value).every((v) => typeof v === 'string');
}

/** A flat object of string values: `{ "city": "bj" }`; no nesting, no NUL characters, at most 32 keys. */
export function IsFlatStringRecord(options?: ValidationOptions): PropertyDecorator {
  return (target: object, propertyName: string | symbol) => {
    registerDecorator({
      name: 'isFlatStringRecord',
      target: target.constructor,
      propertyName: String(propertyName),
      options: {
        message: `$property must be a flat object of at most ${MAX_ATTRIBUTES} string values (keys 1-${MAX_ATTRIBUTE_KEY} characters, values up to ${MAX_ATTRIBUTE_VALUE})`,
        ...options,
      },
      validator: {
        validate(value: unknown): boolean {
          if (!isStringRecord(value)) return false;
          const entries = Object.entries(value);
          return (
            entries.length <= MAX_ATTRIBUTES &&
            entries.every(
              ([k, v]) =>
                k.length >= 1 &&
                charLength(k) <= MAX_ATTRIBUTE_KEY &&
                !k.includes('\0') &&
                charLength(v) <= MAX_ATTRIBUTE_VALUE &&
                !v.includes('\0'),
            )
          );
        },
      },
    });
  };
}
