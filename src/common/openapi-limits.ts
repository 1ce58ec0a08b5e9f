import type { OpenAPIObject } from '@nestjs/swagger';
import { getMetadataStorage, ValidationTypes } from 'class-validator';
import type { ValidationMetadata } from 'class-validator/types/metadata/ValidationMetadata.js';
import { MAX_ATTRIBUTES, MAX_ATTRIBUTE_KEY, MAX_ATTRIBUTE_VALUE, RESOURCE_ID } from './validators.js';

type Schema = Record<string, unknown>;

/** What a validation decorator, by its class-validator name, says about the value it checks. */
const LIMITS: Record<string, (constraints: unknown[]) => Schema> = {
  isInt: () => ({ type: 'integer' }),
  min: ([n]) => ({ minimum: n }),
  max: ([n]) => ({ maximum: n }),
  isCharLength: ([min, max]) => ({ minLength: min, maxLength: max }),
  matches: ([pattern]) => ({ pattern: pattern instanceof RegExp ? pattern.source : String(pattern) }),
  arrayMinSize: ([n]) => ({ minItems: n }),
  arrayMaxSize: ([n]) => ({ maxItems: n }),
  arrayUnique: () => ({ uniqueItems: true }),
  isIn: ([values]) => ({ enum: values }),
  isResourceId: () => ({ type: 'string', pattern: RESOURCE_ID.source }),
  isFlatStringRecord: () => ({
    type: 'object',
    maxProperties: MAX_ATTRIBUTES,
    // OpenAPI 3.0's schemas have no propertyNames (JSON Schema's): an extension, and the DTO's description, say it.
    'x-propertyNames': { minLength: 1, maxLength: MAX_ATTRIBUTE_KEY },
    additionalProperties: { type: 'string', maxLength: MAX_ATTRIBUTE_VALUE },
  }),
};

/**
 * Writes what the DTOs' class-validator decorators enforce into their schemas in the OpenAPI document:
 * integer types, minimum and maximum, string lengths and patterns, array sizes and uniqueness, allowed
 * values. The document then states the limits the service checks, taken from the decorators that check
 * them; in `@ApiProperty` they were a second copy to keep in step, and were not (integer fields
 * documented as `number`, one with no type at all). `@ApiProperty` gives the descriptions.
 */
export function addValidationLimits(document: OpenAPIObject): OpenAPIObject {
  const schemas = (document.components?.schemas ?? {}) as Record<string, Schema>;
  const storage = getMetadataStorage();
  // class-validator keeps its metadata by class and exports no list of the classes: its own map is read.
  const byClass = Reflect.get(storage, 'validationMetadatas') as Map<unknown, ValidationMetadata[]> | undefined;
  for (const target of byClass?.keys() ?? []) {
    if (typeof target !== 'function') continue;
    const properties = schemas[target.name]?.properties as Record<string, Schema> | undefined;
    if (!properties) continue;
    // A validated body refuses fields it does not name (DtoValidationPipe).
    schemas[target.name].additionalProperties = false;
    for (const metadata of storage.getTargetValidationMetadatas(target, '', true, false)) {
      const property = properties[metadata.propertyName];
      const limit = metadata.type === ValidationTypes.CUSTOM_VALIDATION && metadata.name ? LIMITS[metadata.name] : undefined;
      if (!property || !limit) continue;
      const items = property.items as Schema | undefined;
      Object.assign(metadata.each && items && !('$ref' in items) ? items : property, limit(metadata.constraints ?? []));
    }
  }
  return document;
}
