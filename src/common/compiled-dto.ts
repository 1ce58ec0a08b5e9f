import { createRequire } from 'node:module';
import { TransformationType } from 'class-transformer';
import type { MetadataStorage as TransformerMetadata } from 'class-transformer/types/MetadataStorage.js';
import { getMetadataStorage, ValidationTypes } from 'class-validator';
import type { ValidationArguments } from 'class-validator';
import type { ValidationMetadata } from 'class-validator/types/metadata/ValidationMetadata.js';

/** A DTO class: built with `new` and no arguments, as class-transformer builds it. */
export type DtoClass = new () => object;

/**
 * A DTO class's decorators compiled once into two plain functions, for the hot path of every request:
 *
 * - `build(plain)` makes the instance `plainToInstance(cls, plain)` makes from a JSON value: a `cls`
 *   instance with the plain keys copied (`__proto__` and `constructor` skipped, as class-transformer
 *   does, like any key naming a function of the instance, such as `toString`; the caller refuses them), nested objects and arrays
 *   copied, `@Type` properties built as instances of their class. One difference: inside a plain record
 *   (`attributes`) every key is data, where class-transformer throws a TypeError on "constructor" and
 *   drops "toString" and its kind.
 * - `passes(instance)` says whether `validateSync(instance, { whitelist, forbidNonWhitelisted,
 *   forbidUnknownValues })` would find no error: the same metadata, the same constraint instances
 *   called with the same arguments, the same rules for `@IsOptional`, `each`, nested objects and unknown
 *   keys, without class-validator's per-call grouping of the metadata and its error objects.
 *
 * A value `passes` refuses still goes through `validateSync` for the messages (`DtoValidationPipe`),
 * so a 400 reads as before; `passes` only spares valid requests that work. A class using anything
 * this does not mirror (`@Transform`, `@Expose`, `@Exclude`, discriminators, a `@Type` function that
 * takes arguments, async or promise validation, schemas, methods or accessors) is not compiled, and
 * the pipe uses class-transformer and class-validator as they are. `test/unit/compiled-dto.test.ts` checks both functions against the two
 * libraries on every DTO, over valid and invalid values alike.
 */
export interface CompiledDto {
  /** `skipped` collects the fields (as `items.0.toString`) of the keys build leaves out, to refuse them. */
  build(plain: object, skipped?: string[]): object;
  passes(instance: object): boolean;
  /**
   * The fields (as `items.0.colour`) of the keys `plain` has that the class, or the class of a nested object, does
   * not name (which validateSync refuses one error object each): the first `limit`, and how many in all.
   */
  unknownFields(plain: object, limit: number): { fields: string[]; count: number };
}

// class-transformer's decorator metadata; not exported by its index, so read from the module its decorators use.
const { defaultMetadataStorage } = createRequire(import.meta.url)('class-transformer/cjs/storage.js') as {
  defaultMetadataStorage: TransformerMetadata;
};

type Check = (object: Record<string, unknown>, value: unknown) => boolean;

interface PropertyRule {
  name: string;
  /** `@IsOptional` / `@ValidateIf`: when one is false, nothing else of the property is checked. */
  conditions: Check[];
  /** `@IsDefined`, then every other constraint. */
  checks: Check[];
  nested: boolean;
}

interface ClassRule {
  known: Set<string>;
  properties: PropertyRule[];
  /** Property → class of its `@Type`, for build. */
  types: Map<string, DtoClass>;
}

const compiled = new Map<unknown, ClassRule | null>();
const dtos = new Map<DtoClass, CompiledDto | undefined>();

/** The compiled form of a DTO class (compiled on first use), or undefined when it uses something not mirrored here. */
export function compileDto(cls: DtoClass): CompiledDto | undefined {
  if (!dtos.has(cls)) {
    const rule = ruleOf(cls);
    dtos.set(
      cls,
      rule
        ? {
            build: (plain, skipped) => buildChecked(cls, rule, plain, skipped),
            passes,
            unknownFields: (plain, limit) => {
              const found = { fields: [] as string[], count: 0 };
              collectUnknown(rule, plain, '', limit, found);
              return found;
            },
          }
        : undefined,
    );
  }
  return dtos.get(cls);
}

function ruleOf(cls: DtoClass): ClassRule | null {
  if (compiled.has(cls)) return compiled.get(cls)!;
  compiled.set(cls, null); // a class nested in itself is refused rather than looped over
  const rule = compileClass(cls);
  compiled.set(cls, rule);
  return rule;
}

function compileClass(cls: DtoClass): ClassRule | null {
  const storage = getMetadataStorage();
  // The arguments validateSync's executor passes for a class without groups or schemas.
  const metadatas = storage.getTargetValidationMetadatas(cls, undefined as unknown as string, false, false, undefined);
  if (metadatas.length === 0) return null;
  if (hasAccessorsOrMethods(cls)) return null;
  if (
    defaultMetadataStorage.getStrategy(cls) !== 'none' ||
    defaultMetadataStorage.getExposedMetadatas(cls).length > 0 ||
    defaultMetadataStorage.getExcludedMetadatas(cls).length > 0
  ) {
    return null;
  }
  const byProperty = storage.groupByPropertyName(metadatas);
  const properties: PropertyRule[] = [];
  const types = new Map<string, DtoClass>();
  for (const [name, list] of Object.entries(byProperty)) {
    if (defaultMetadataStorage.findTransformMetadatas(cls, name, TransformationType.PLAIN_TO_CLASS).length > 0) return null;
    const type = defaultMetadataStorage.findTypeMetadata(cls, name);
    if (type) {
      const nestedClass = type.options?.discriminator ? undefined : typeOf(type.typeFunction);
      const container = type.reflectedType as unknown;
      const plainContainer = container === undefined || container === Array || container === Object || container === nestedClass;
      if (!nestedClass || !plainContainer || !isPlainClass(nestedClass) || !ruleOf(nestedClass)) return null;
      types.set(name, nestedClass);
    }
    const rule: PropertyRule = { name, conditions: [], checks: [], nested: false };
    const defined: Check[] = [];
    for (const metadata of list) {
      if (typeof metadata.target === 'string') return null;
      switch (metadata.type) {
        case ValidationTypes.CONDITIONAL_VALIDATION:
          rule.conditions.push(metadata.constraints[0] as Check);
          break;
        case ValidationTypes.IS_DEFINED:
        case ValidationTypes.CUSTOM_VALIDATION: {
          const check = constraintCheck(metadata);
          if (!check) return null;
          (metadata.type === ValidationTypes.IS_DEFINED ? defined : rule.checks).push(check);
          break;
        }
        case ValidationTypes.NESTED_VALIDATION:
          rule.nested = true;
          break;
        case ValidationTypes.WHITELIST:
          break;
        default:
          return null;
      }
    }
    rule.checks.unshift(...defined);
    properties.push(rule);
  }
  return { known: new Set(Object.keys(byProperty)), properties, types };
}

/** Methods or accessors on the class or a parent class: class-transformer skips keys named like them. */
function hasAccessorsOrMethods(cls: DtoClass): boolean {
  for (
    let proto = cls.prototype as object | null;
    proto && proto !== Object.prototype;
    proto = Object.getPrototypeOf(proto) as object | null
  ) {
    if (Object.getOwnPropertyNames(proto).some((name) => name !== 'constructor')) return true;
  }
  return false;
}

/**
 * The class a `@Type(() => Class)` names; undefined for a type function that takes class-transformer's
 * arguments (its class may depend on the value) or throws without them.
 */
function typeOf(typeFunction: ((...args: never[]) => unknown) | undefined): DtoClass | undefined {
  if (!typeFunction || typeFunction.length > 0) return undefined;
  try {
    return typeFunction() as DtoClass | undefined;
  } catch {
    return undefined;
  }
}

/** A class class-transformer would build with `new` and plain assignments (no constructor parameters used). */
function isPlainClass(cls: unknown): boolean {
  return (
    cls !== String && cls !== Number && cls !== Boolean && cls !== Date && cls !== Map && cls !== Set && cls !== Array && cls !== Object
  );
}

/** What a check's shared arguments name as the object between calls. */
const NO_OBJECT: object = Object.freeze({});

/** One `customValidation` (or `isDefined`) metadata as ValidationExecutor.customValidations runs it in validateSync. */
function constraintCheck(metadata: ValidationMetadata): Check | undefined {
  const constraints = getMetadataStorage().getTargetValidatorConstraints(metadata.constraintCls);
  if (constraints.some((c) => c.async)) return undefined; // validateSync skips these; nothing to mirror
  const validators = constraints.map((c) => c.instance as { validate(value: unknown, args: ValidationArguments): unknown });
  const { each, validateIf, propertyName, constraints: values } = metadata;
  // One arguments object for every call, filled in for each: an import checks tens of thousands of values, and
  // the checks are synchronous (nothing keeps it past its call); emptied after, so it holds on to no request.
  const args: ValidationArguments = { targetName: '', property: propertyName, object: NO_OBJECT, value: undefined, constraints: values };
  const checkAll = (object: Record<string, unknown>, value: unknown): boolean => {
    for (const validator of validators) {
      if (!each || !(Array.isArray(value) || value instanceof Set || value instanceof Map)) {
        const valid = validator.validate(value, args);
        if (!isPromise(valid) && !valid) return false;
        continue;
      }
      const results = Array.from(value instanceof Map ? value.values() : value, (element) => validator.validate(element, args));
      if (!results.some(isPromise) && !results.every(Boolean)) return false;
    }
    return true;
  };
  return (object, value) => {
    if (validateIf && !validateIf(object, value)) return true;
    args.targetName = object.constructor?.name;
    args.object = object;
    args.value = value;
    try {
      return checkAll(object, value);
    } finally {
      args.object = NO_OBJECT;
      args.value = undefined;
    }
  };
}

function isPromise(value: unknown): boolean {
  return value !== null && typeof value === 'object' && typeof (value as { then?: unknown }).then === 'function';
}

/** ValidationExecutor.execute for an instance: unknown keys, then every property. */
function passes(object: object): boolean {
  const rule = compiled.get(object.constructor);
  if (!rule) return false; // forbidUnknownValues: an object of a class without metadata
  for (const key in object) if (Object.hasOwn(object, key) && !rule.known.has(key)) return false;
  const record = object as Record<string, unknown>;
  for (const property of rule.properties) {
    const value = record[property.name];
    if (!all(property.conditions, record, value)) continue;
    if (!all(property.checks, record, value)) return false;
    if (property.nested && !nestedPasses(value)) return false;
  }
  return true;
}

/** `checks.every(...)` without a closure a call: this runs for every property of every request. */
function all(checks: Check[], object: Record<string, unknown>, value: unknown): boolean {
  for (const check of checks) if (!check(object, value)) return false;
  return true;
}

/** ValidationExecutor.nestedValidations: undefined passes; arrays element by element; objects by their class. */
function nestedPasses(value: unknown): boolean {
  if (value === undefined) return true;
  if (Array.isArray(value) || value instanceof Set || value instanceof Map) {
    for (const element of value instanceof Map ? value.values() : value) if (!nestedPasses(element)) return false;
    return true;
  }
  return value instanceof Object && passes(value);
}

function collectUnknown(rule: ClassRule, plain: object, path: string, limit: number, found: { fields: string[]; count: number }): void {
  for (const key in plain) {
    if (!Object.hasOwn(plain, key)) continue;
    const field = path ? `${path}.${key}` : key;
    if (!rule.known.has(key)) {
      if (found.count++ < limit) found.fields.push(field);
      continue;
    }
    const type = rule.types.get(key);
    const value = (plain as Record<string, unknown>)[key];
    if (!type || value === null || typeof value !== 'object') continue;
    const inner = compiled.get(type)!;
    if (!Array.isArray(value)) collectUnknown(inner, value, field, limit, found);
    else {
      for (let i = 0; i < value.length; i++) {
        const element: unknown = value[i];
        if (element !== null && typeof element === 'object' && !Array.isArray(element))
          collectUnknown(inner, element, `${field}.${i}`, limit, found);
      }
    }
  }
}

/** Thrown by a build that keeps no paths when it meets a key to skip. */
const SKIPS = Symbol('skips');

/**
 * build, first without the field paths (an import has tens of thousands of them), and again with them only
 * when a key is skipped, which a valid request never has.
 */
function buildChecked(cls: DtoClass, rule: ClassRule, plain: object, skipped: string[] | undefined): object {
  try {
    return build(cls, rule, plain, undefined, null);
  } catch (err) {
    if (err !== SKIPS) throw err;
    return build(cls, rule, plain, skipped, '');
  }
}

/**
 * plainToInstance for a JSON value whose class has a rule. A key naming a function of the instance
 * (toString, hasOwnProperty...) is skipped, as class-transformer skips it, so validation never sees it:
 * its field goes to `skipped`, for the caller to refuse like any unknown field. With `path` null, no
 * field is written down: a key to skip throws SKIPS.
 */
function build(cls: DtoClass, rule: ClassRule, plain: object, skipped: string[] | undefined, path: string | null): object {
  const instance = new cls() as Record<string, unknown>;
  for (const key in plain) {
    if (!Object.hasOwn(plain, key)) continue;
    const field = path === null ? null : path ? `${path}.${key}` : key;
    if (key === '__proto__' || key === 'constructor' || instance[key] instanceof Function) {
      if (field === null) throw SKIPS;
      skipped?.push(field);
      continue;
    }
    const value = (plain as Record<string, unknown>)[key];
    const type = rule.types.get(key);
    instance[key] = type ? buildTyped(type, value, skipped, field) : copy(value);
  }
  return instance;
}

function buildTyped(type: DtoClass, value: unknown, skipped: string[] | undefined, path: string | null): unknown {
  if (Array.isArray(value)) return value.map((element, i) => buildTyped(type, element, skipped, path === null ? null : `${path}.${i}`));
  if (value === null || typeof value !== 'object') return value;
  return build(type, compiled.get(type)!, value, skipped, path);
}

/**
 * A JSON value copied as class-transformer copies an untyped one, except that every key is kept as data
 * (an attribute may be called "constructor" or "toString"): class-transformer threw on "constructor"
 * (a 500) and silently dropped keys named like a function every object has.
 */
function copy(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(copy);
  if (value === null || typeof value !== 'object') return value;
  const out: Record<string, unknown> = {};
  for (const key in value) {
    if (!Object.hasOwn(value, key) || key === '__proto__') continue; // Fastify refuses it before this; it would set the prototype
    out[key] = copy((value as Record<string, unknown>)[key]);
  }
  return out;
}
